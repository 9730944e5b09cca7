"""Reasoning ("<think>...</think>") split from the answer, whole or as it streams.

Two conventions of think tags, one per REASONING_PARSERS entry (the third, openai_gptoss, is
gpt-oss's harmony messages: HarmonyReasoningParser below):

- qwen3: the model opens the block itself: `<think>\\n...\\n</think>\\n\\n` then the answer.
  An output that does not start (after whitespace) with `<think>` has no reasoning and is
  all content, verbatim: with enable_thinking=false the template put an empty block in the
  prompt and the model writes only the answer.
- deepseek_r1: the template already wrote `<think>\\n` into the prompt, so the output starts
  inside the reasoning (a leading `<think>` is accepted and dropped anyway).

Either way the reasoning runs to `</think>`; an output that never closes it is all
reasoning. What is stripped, as vLLM does: the tags; the whitespace at both ends of the
reasoning (the newlines inside the tags); the whitespace at the start of the content that
follows `</think>` (the "\\n\\n"). Content after the tag is otherwise verbatim.

ReasoningParser.split() is the stream fed the whole text at once, so for any splitting of
an output the streamed fragments concatenate to exactly split()'s answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamer.server.harmony import Body, Close, Event, HarmonyReader, Open, Text, verbatim_open
from streamer.server.text_pieces import Stripped, partial_tag


@dataclass(frozen=True)
class ReasoningParser:
    """One convention; stateless. starts_inside: the prompt already opened the block."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None when there is none."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2) or None, c1 + c2

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """The split of one output as it streams: feed() each piece of text, finish() at the end.

    Held back, never emitted in either channel: a possible partial tag at the end of the
    text seen so far, whitespace at the start of the output (qwen3 does not know yet whether
    `<think>` follows), and whitespace at the end of the reasoning (it may be the last before
    `</think>`, which strips it).

    `ended` is True once the reasoning is over: the end tag has been seen, or (qwen3) the
    output turned out to have no think block. A grammar may constrain tokens from there."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.ended = False
        self._buf = ""
        self._state = "start"  # start -> reasoning -> after -> content
        self._reasoning = Stripped()
        self._content: list[str] = []

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning fragment, content fragment) safe to emit now."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of output: what was held back (a trailing partial tag is text then)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        while self._step(final):
            pass
        out = self._reasoning.take(), "".join(self._content)
        self._content = []
        return out

    def _take(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _step(self, final: bool) -> bool:
        """Decide what can be decided at the head of the buffer; True to be called again."""
        start, end = self.parser.start, self.parser.end
        rest = self._buf.lstrip()
        if self._state == "start":
            if len(rest) < len(start) and start.startswith(rest) and not final:
                return False
            if rest.startswith(start):
                self._take(len(self._buf) - len(rest) + len(start))
                self._state = "reasoning"
            elif self.parser.starts_inside:
                self._state = "reasoning"
            else:
                self._state, self.ended = "content", True
            return True
        if self._state == "reasoning":
            i = self._buf.find(end)
            if i < 0:
                keep = 0 if final else partial_tag(self._buf, end)
                self._reason(self._take(len(self._buf) - keep))
                return False
            self._reason(self._take(i))
            self._take(len(end))
            self._state, self.ended = "after", True
            return True
        if self._state == "after":
            self._take(len(self._buf) - len(rest))
            if not rest:
                return False
            self._state = "content"
        self._content.append(self._take(len(self._buf)))
        return False

    def _reason(self, text: str) -> None:
        """Reasoning text out, stripped at both ends across all the pieces."""
        self._reasoning.add(text)


@dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """openai_gptoss: gpt-oss's harmony messages (harmony.py), as vLLM's parser of that name.

    Reasoning: the bodies of the analysis-channel messages, joined by "\\n". Content: the
    bodies of the final-channel messages (and of commentary without a recipient, gpt-oss's
    "preambles" to the user; any other channel), joined by "\\n", and text outside any
    message verbatim (an output without markers is all content). A message with a
    recipient (`to=functions.NAME`, or a built-in tool's `to=browser.search`) is a tool
    call: it goes on to the content as harmony markup, always opened by `<|start|>`, for the
    tool-call parser "openai" to read (without one, the client sees it as written). No
    marker of the other messages reaches either channel; nothing is stripped."""

    def stream(self) -> ReasoningStream:
        return HarmonyReasoningStream(self)


class HarmonyReasoningStream(ReasoningStream):
    """ReasoningStream's contract over harmony messages; `ended` once a message that is not
    analysis opens (or text outside any message comes)."""

    def __init__(self, parser: ReasoningParser) -> None:
        super().__init__(parser)
        self._reader = HarmonyReader()
        self._kind = ""  # the open message's: "reasoning" | "content" | "markup"
        self._fresh = False  # the open message's body has not begun yet
        self._had = {"reasoning": False, "content": False}  # a message of that kind had text

    def feed(self, delta: str) -> tuple[str, str]:
        return self._read(self._reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._read(self._reader.finish())

    def _read(self, events: list[Event]) -> tuple[str, str]:
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        for e in events:
            if isinstance(e, Text):
                out["content"].append(e.text)
                self.ended = True
            elif isinstance(e, Open):
                h = e.header
                self._kind = "markup" if h.recipient is not None else "reasoning" if h.channel == "analysis" \
                    else "content"
                self._fresh = True
                self.ended = self.ended or self._kind != "reasoning"
                if self._kind == "markup":
                    out["content"].append(verbatim_open(e, start=True))
            elif isinstance(e, Body):
                if self._kind == "markup":
                    out["content"].append(e.text)
                    continue
                if self._fresh and self._had[self._kind]:
                    out[self._kind].append("\n")
                self._fresh, self._had[self._kind] = False, True
                out[self._kind].append(e.text)
            elif isinstance(e, Close) and self._kind == "markup":
                out["content"].append(e.terminator)
        return "".join(out["reasoning"]), "".join(out["content"])


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (ReasoningParser("qwen3"), ReasoningParser("deepseek_r1", starts_inside=True),
                        HarmonyReasoningParser("openai_gptoss"))
}
