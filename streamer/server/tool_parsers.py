"""Tool calls out of model output text, for the formats hermes, llama3_json, mistral, openai
(gpt-oss's harmony messages, harmony.py), deepseek_v3 and deepseek_v31
(tool_parsers_deepseek.py), qwen3_coder and glm45 (Qwen3-Coder's and GLM-4.5's XML,
tool_parsers_xml.py).

Each format is one incremental grammar, a ToolStream (tool_stream.py says what a stream
holds back and when it emits): feed() it the output as it is detokenized, finish() it at
the end. ToolParser.parse() is that same stream fed the whole text at once, so the
non-streamed answer and the streamed one cannot drift apart: for any splitting of an
output, the content and calls a stream emits are exactly parse()'s. Content is the text
outside the markup, concatenated and stripped; a call's arguments are its parsed arguments
re-dumped (json.dumps, ensure_ascii=False), emitted in one delta when the call completes.

Tags are matched as text, so the detokenizer must keep them: "<tool_call>" is an ordinary
added token, but "[TOOL_CALLS]" and "<|python_tag|>" are special tokens in most
tokenizers and vanish under skip_special_tokens=True. A parser's `markers` are the special
tokens it reads: the server keeps them in the text of the requests it parses
(SamplingParams.keep_special_tokens).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from streamer.chat_template import DEEPSEEK_MARKERS, markup_format
from streamer.server.harmony import (
    HARMONY_MARKERS,
    Body,
    Close,
    Event,
    HarmonyReader,
    Open,
    Text,
    verbatim_open,
)
from streamer.server.tool_parsers_deepseek import DeepSeekV3Stream, DeepSeekV31Stream
from streamer.server.tool_parsers_xml import Glm45Stream, Qwen3CoderStream
from streamer.server.tool_stream import (
    ToolCall,
    ToolCallDelta,
    ToolStream,
    collect_calls,
    decode_json,
    new_call_id,
)

__all__ = ["PARSERS", "ToolCall", "ToolCallDelta", "ToolParser", "ToolStream", "collect_calls", "parser_for"]


# ---- call objects ------------------------------------------------------------------------


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_id(given: Any) -> str:
    """The model's own id when it has the shape Mistral's templates insist on (9
    alphanumerics, or they raise when the conversation comes back), else a fresh one."""
    if isinstance(given, str) and _MISTRAL_ID.fullmatch(given):
        return given
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _as_call(obj: Any, call_id: str) -> ToolCall | None:
    """The call one decoded object describes, or None when it is not one: no name, or
    arguments that are not an object (a JSON-encoded object string is accepted)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = decode_json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(call_id, obj["name"], json.dumps(args, ensure_ascii=False))


# ---- the formats -----------------------------------------------------------------------


class HermesStream(ToolStream):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated.

    The call's JSON is found by bracket counting, not by searching for the close tag, so a
    "</tool_call>" inside an argument string cannot cut it. A missing close tag is
    forgiven once the JSON is complete (models forget it, and finish() must count it)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._call: ToolCall | None = None

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._text_until(self.OPEN, "open", final)
        rest = buf.lstrip() if self._state != "object" else buf  # (a call's body can be long)
        if self._state == "open":
            if not rest:
                if final:
                    self._fail("text")
                return final
            if rest[0] != "{":
                self._fail("text")
            else:
                self._hold(len(buf) - len(rest), "object")
            return True
        if self._state == "object":
            end = self._scan.end(buf)
            if end is None:
                if final:
                    self._fail("text")
                return final
            self._call = _as_call(decode_json(buf[:end]), new_call_id())
            if self._call is None:
                self._fail("text")
            else:
                self._hold(end, "close")
            return True
        # "close": the call is complete; consume its close tag when it comes
        if not final and len(rest) < len(self.CLOSE) and self.CLOSE.startswith(rest):
            return False
        if rest.startswith(self.CLOSE):
            self._take(len(buf) - len(rest) + len(self.CLOSE))
        elif self.CLOSE.startswith(rest):
            self._take(len(buf))  # a close tag cut off by the end of output
        assert self._call is not None
        self._emit(self._call)
        self._state = "text"
        return True


class Llama3JsonStream(ToolStream):
    """Optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects joined
    by "; ". Decided at the first non-whitespace character: "{" is a call, anything else
    makes the whole output content. An object that is not a call makes it and everything
    after it content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"

    def _step(self, final: bool) -> bool:
        buf = self._buf
        rest = buf.lstrip() if self._state != "object" else buf  # (a call's body can be long)
        if self._state == "start":
            if rest.startswith(self.TAG):
                rest = rest[len(self.TAG) :].lstrip()
            elif self.TAG.startswith(rest) and not final:
                return False  # nothing yet, or a partial tag
            if not rest and not final:
                return False
            if rest[:1] == "{":
                self._hold(len(buf) - len(rest), "object")
            else:
                self._state = "content"
            return True
        if self._state == "object":
            end = self._scan.end(buf)
            if end is None and not final:
                return False
            call = None if end is None else _as_call(decode_json(buf[:end]), new_call_id())
            if call is None:
                self._fail("content")
            else:
                self._take(end or 0)
                self._emit(call)
                self._state = "after"
            return True
        if self._state == "after":
            after = rest[1:].lstrip() if rest[:1] == ";" else rest
            if not after and not final:
                return False  # whitespace, or a separator without its next call yet
            if rest[:1] == ";" and after[:1] == "{":
                self._hold(len(buf) - len(after), "object")
            else:
                self._state = "content"
            return True
        self._content(self._take(len(buf)))
        return False


class MistralStream(ToolStream):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}, ...]`, or the
    newer `[TOOL_CALLS]NAME[ARGS]{...}` (with an optional `[CALL_ID]id` before `[ARGS]`)
    once per call. An array's calls go out together when the array closes."""

    TAG = "[TOOL_CALLS]"
    MARKERS = (TAG, "[ARGS]", "[CALL_ID]")
    """Control tokens of Mistral's tokenizers (dropped by skip_special_tokens unless kept)."""
    _HEADER = re.compile(r"([\w.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")
    _HEADER_SO_FAR = re.compile(r"[\w.\-\[\]]{0,200}")  # what a header not yet complete may be

    def __init__(self) -> None:
        super().__init__()
        self._name, self._id = "", ""

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._text_until(self.TAG, "tag", final)
        if self._state == "tag":
            rest = buf.lstrip()
            if not rest:
                if final:
                    self._fail("text")
                return final
            self._hold(len(buf) - len(rest), "array" if rest[0] == "[" else "name")
            return True
        if self._state == "name":  # NAME[ARGS] or NAME[CALL_ID]id[ARGS], then the object
            i = buf.find("[ARGS]")
            if i < 0:
                if final or not self._HEADER_SO_FAR.fullmatch(buf):
                    self._fail("text")
                    return True
                return False
            header = self._HEADER.fullmatch(buf, 0, i + len("[ARGS]"))
            rest = buf[i + len("[ARGS]") :].lstrip()
            if header and rest[:1] == "{":
                self._name, self._id = header.group(1), header.group(2) or ""
                self._hold(len(buf) - len(rest), "object")
            elif header and not rest and not final:
                return False
            else:
                self._fail("text")
            return True
        # "array" or "object": its calls are complete when the JSON value closes
        end = self._scan.end(buf)
        if end is None and not final:
            return False
        calls = [] if end is None else self._calls(buf[:end])
        if calls and all(calls):
            self._take(end or 0)
            for call in calls:
                assert call is not None
                self._emit(call)
            self._state = "text"
        else:
            self._fail("text")
        return True

    def _calls(self, text: str) -> list[ToolCall | None]:
        """The calls a closed array (or the object after NAME[ARGS]) spells: None for an
        item that is not a call."""
        value = decode_json(text)
        if self._state == "object":
            return [_as_call({"name": self._name, "arguments": value}, _mistral_id(self._id))]
        if not isinstance(value, list):
            return []
        return [_as_call(x, _mistral_id(x.get("id") if isinstance(x, dict) else None)) for x in value]


class HarmonyStream(ToolStream):
    """openai: gpt-oss's harmony messages (harmony.py), as vLLM's tool-call parser of that
    name. A message to `functions.NAME` is a call of NAME whose arguments are its body as
    written (stripped of surrounding whitespace; "{}" when empty), emitted when the message
    ends (`<|call|>`, `<|end|>`, the next message, or the end of the output: `<|call|>` is
    an EOS token). Content: the bodies of final-channel messages and of commentary without a
    recipient (joined by "\\n"), text outside any message verbatim; every other message
    (analysis, when no reasoning parser took it; one to another recipient, such as a built-in
    tool's `to=browser.search`, which is no function the client defined) stays in the
    content as written, markup included: shown, never dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._reader = HarmonyReader()
        self._kind = ""  # the open message's: "call" | "content" | "markup"
        self._name = ""
        self._args: list[str] = []
        self._fresh = False
        self._had_content = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._read(self._reader.feed(delta))
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._read(self._reader.finish())
        return self._drain(final=True)

    def _step(self, final: bool) -> bool:
        return False  # (the reader decides; _read has emitted what it did)

    def _read(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Text):
                self._content(e.text)
            elif isinstance(e, Open):
                h = e.header
                name = h.function
                if name is not None:
                    self._kind, self._name, self._args = "call", name, []
                elif h.recipient is None and h.channel in (None, "final", "commentary"):
                    self._kind, self._fresh = "content", True
                else:
                    self._kind = "markup"
                    self._content(verbatim_open(e))
            elif isinstance(e, Body):
                if self._kind == "call":
                    self._args.append(e.text)
                elif self._kind == "content":
                    if self._fresh and self._had_content:
                        self._content("\n")
                    self._fresh, self._had_content = False, True
                    self._content(e.text)
                else:
                    self._content(e.text)
            elif isinstance(e, Close):
                if self._kind == "call":
                    self._emit(ToolCall(new_call_id(), self._name, "".join(self._args).strip() or "{}"))
                elif self._kind == "markup":
                    self._content(e.terminator)
                self._kind = ""


# ---- the parsers -------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolParser:
    """One format: stateless; stream() starts the parse of one output."""

    name: str
    stream_type: type[ToolStream]
    markers: tuple[str, ...] = ()
    """Special tokens the stream reads, to be kept in the text under skip_special_tokens."""
    typed: bool = False
    """Its markup writes arguments untyped (qwen3_coder's XML): the tools' schemas type them."""
    schemas: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    """Each tool's parameters schema, by name (with_schemas), for a typed format."""

    def with_schemas(self, tools: list[dict[str, Any]]) -> ToolParser:
        """This parser reading a request's tools (OpenAI's function tools), where it needs them."""
        if not self.typed:
            return self
        schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools
                   if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]}
        return replace(self, schemas=schemas)

    def stream(self) -> ToolStream:
        if self.typed:
            return self.stream_type(self.schemas)  # type: ignore[call-arg]
        return self.stream_type()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output: the stream, fed it at once."""
        s = self.stream()
        content, deltas = s.feed(text)
        rest, more = s.finish()
        return content + rest, collect_calls(deltas + more)


PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        ToolParser("hermes", HermesStream, (HermesStream.OPEN, HermesStream.CLOSE)),
        ToolParser("llama3_json", Llama3JsonStream, (Llama3JsonStream.TAG,)),
        ToolParser("mistral", MistralStream, MistralStream.MARKERS),
        ToolParser("openai", HarmonyStream, HARMONY_MARKERS),
        ToolParser("deepseek_v3", DeepSeekV3Stream, DEEPSEEK_MARKERS),
        ToolParser("deepseek_v31", DeepSeekV31Stream, DEEPSEEK_MARKERS),
        ToolParser("qwen3_coder", Qwen3CoderStream, (Qwen3CoderStream.OPEN, Qwen3CoderStream.CLOSE), typed=True),
        ToolParser("glm45", Glm45Stream, Glm45Stream.MARKERS, typed=True),
    )
}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser called `name`, or for "auto" the one whose markup the chat template
    writes (the template is what taught the model its format; chat_template.markup_format)."""
    choices = ", ".join(["auto", *PARSERS])
    if name in PARSERS:
        return PARSERS[name]
    if name != "auto":
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {choices}")
    fmt = markup_format(chat_template or "")
    if fmt is None:
        raise ValueError(f"no tool-call format recognized in the chat template; choose one of: {choices}")
    return PARSERS[fmt]
