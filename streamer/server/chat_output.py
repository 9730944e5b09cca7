"""What a chat request wants of its output beyond text: tool calls and reasoning.

`ChatSetup.of(body, ...)` decides once per request, from the body and the server's flags:
the tool-call parser and grammar (tool_choice), the reasoning parser, and where a grammar
starts (after the reasoning). `ChatOutput` then turns one choice's text into reasoning,
content and tool calls: whole (`parse`) or as it streams (`feed`, `finish`), with the same
result either way (the parsers' contract, tests/server/test_tool_parsers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamer.chat_template import tool_format
from streamer.errors import RequestError
from streamer.messages import GrammarSpec
from streamer.server.harmony import HARMONY_MARKERS
from streamer.server.protocol import ApiError
from streamer.server.reasoning import REASONING_PARSERS, HarmonyReasoningParser, ReasoningParser
from streamer.server.tool_grammar import after_reasoning, tool_call_grammar
from streamer.server.tool_parsers import ToolCall, ToolCallDelta, ToolParser, parser_for

REASONING_START = {"qwen3": "<think>", "deepseek_r1": None}
"""Where the model's output starts: with its own <think> (qwen3), or already inside the
reasoning that the template opened (deepseek_r1)."""


@dataclass
class ChatSetup:
    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    grammar: GrammarSpec | None = None
    """The request's constraint: tool_choice's, or the body's own; after the reasoning."""
    keep_special: tuple[str, ...] = ()
    """Special tokens whose text the parsers read, kept in the output's text under
    skip_special_tokens (SamplingParams.keep_special_tokens): the tool parser's markers
    (ToolParser.markers: harmony's, DeepSeek's), or the harmony reasoning parser's."""

    @classmethod
    def of(cls, *, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool, grammar: GrammarSpec | None,
           template_kwargs: dict[str, Any], hf_tokenizer: Any, tool_parser: str, reasoning_parser: str | None
           ) -> ChatSetup:
        """tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
        (None: "auto" with tools, as OpenAI's default). tool_parser: --tool-call-parser (auto:
        from the template); reasoning_parser: --reasoning-parser."""
        setup = cls(grammar=grammar)
        # without tools, "none" and "auto" mean the same plain reply (clients send them by
        # default, and vLLM takes them); a call they force could not be made
        if tool_choice not in (None, "none", "auto") and not tools:
            raise ApiError("tool_choice needs tools", param="tool_choice")
        choice = tool_choice if tool_choice is not None else "auto"
        if tools and choice != "none":
            fmt = tool_format(hf_tokenizer) if tool_parser == "auto" else tool_parser
            if fmt is None:
                raise ApiError("this model's chat template speaks no tool-call format streamer knows: "
                               "start the server with --tool-call-parser", param="tools")
            try:
                setup.tools = parser_for(fmt, None).with_schemas(tools)
                constraint = tool_call_grammar(tools, choice, parallel, fmt)
            except (RequestError, ValueError) as e:
                raise ApiError(str(e), param="tool_choice") from None
            setup.keep_special = setup.tools.markers  # (harmony's, DeepSeek's, Mistral's: special tokens)
            if choice != "auto":
                if grammar is not None:
                    raise ApiError("tool_choice required or a named function cannot be combined with "
                                   "response_format or guided_* (both constrain the output)", param="tool_choice")
                setup.grammar = constraint
            elif grammar is None:
                setup.grammar = constraint  # text, and calls that follow their schema once begun
        if reasoning_parser is not None:
            setup.reasoning = REASONING_PARSERS[reasoning_parser]
            if isinstance(setup.reasoning, HarmonyReasoningParser):
                setup.keep_special = HARMONY_MARKERS
                if setup.grammar is not None:  # (it would hold from the first token: no analysis, no header)
                    raise ApiError("response_format, guided decoding and tool_choice grammars are not supported "
                                   "with the harmony format (--reasoning-parser openai_gptoss)",
                                   param="response_format" if grammar is not None else "tool_choice")
                return setup
            thinking = template_kwargs.get("enable_thinking", True) is not False
            if setup.grammar is not None and thinking:
                setup.grammar = after_reasoning(setup.grammar, end=setup.reasoning.end,
                                                start=REASONING_START[reasoning_parser])
        return setup

    def output(self) -> ChatOutput:
        return ChatOutput(self.tools, self.reasoning)


@dataclass
class Parsed:
    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutput:
    """One choice's output: reasoning first (when parsed), then content with tool calls."""

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools, self.reasoning = tools, reasoning
        self._reasoning = reasoning.stream() if reasoning is not None else None
        self._tools = tools.stream() if tools is not None else None
        self.called = False
        """A tool call has begun (the finish reason becomes "tool_calls")."""

    @property
    def plain(self) -> bool:
        return self.tools is None and self.reasoning is None

    @property
    def in_reasoning(self) -> bool:
        """The text fed so far has not ended the reasoning (False without a reasoning parser)."""
        return self._reasoning is not None and not self._reasoning.ended

    def parse(self, text: str) -> Parsed:
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.parse(content)
        self.called = bool(calls)
        return Parsed(reasoning, content, calls)

    def _content(self, reasoning: str, content: str, end: bool) -> ChatDelta:
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            if end:
                more, later = self._tools.finish()
                content, calls = content + more, calls + later
        self.called = self.called or bool(calls)
        return ChatDelta(reasoning, content, calls)

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._content(reasoning, content, end=False)

    def finish(self) -> ChatDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._content(reasoning, content, end=True)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" where the model ended by calling tools."""
    return "tool_calls" if called and reason == "stop" else reason
