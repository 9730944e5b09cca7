"""The machinery every tool-call format's stream shares (the formats: tool_parsers.py).

A ToolStream is fed the output as it is detokenized and finished at the end; it emits
content as soon as it is safe and calls as soon as they are complete.

NOTE: a call is emitted when its JSON closes, never before. Its first delta carries
index, id and name (arguments ""), the second the whole arguments string, normalized
(json.dumps of the parsed arguments, ensure_ascii=False). Holding a call back until it is
complete is what lets malformed markup (bad JSON, no name) fall back to content verbatim:
a call already streamed could not be taken back. Content streams as it arrives, except:

- text that might still become markup (a trailing "<tool", "[TOOL_C") is held until
  decided, and markup is held until it proves to be a call or not;
- whitespace: content is the text outside the markup, concatenated, then stripped (so
  whitespace around and between calls disappears). A stream drops leading whitespace and
  holds trailing whitespace until non-whitespace content follows it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from streamer.server.text_pieces import Stripped, partial_tag


class ToolCall(msgspec.Struct):
    """One complete call; arguments is a JSON object as a string."""

    id: str
    name: str
    arguments: str


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One piece of a streamed call, as OpenAI streams them: id and name come once, in the
    call's first delta; the arguments fragments of one index concatenate to its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def collect_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that a sequence of deltas spells, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ToolCall(d.id or "", d.name or "", ""))
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def new_call_id() -> str:
    """A fresh call id, where the format carries none of the model's own."""
    return "call_" + uuid.uuid4().hex[:24]


def decode_json(text: str) -> Any:
    """The JSON value text spells, or None where it is not JSON (a malformed call)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# ---- the stream ------------------------------------------------------------------------


class JsonEnd:
    """Finds, incrementally, where the JSON object or array that opens at text[0] closes.

    It counts brackets outside strings (escapes understood) and does not validate:
    json.loads does, once the value has closed. It keeps its place between calls, so a long
    call streamed character by character costs time linear in its length."""

    def __init__(self) -> None:
        self.pos = self.depth = 0
        self.in_string = self.escaped = False

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is still open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


class ToolStream:
    """The incremental parse of one output; subclasses are the formats' grammars, each a
    `_step` over its own named states. One stream per output: nothing is fed after finish().

    Invariant: `_buf` is the text not yet decided; `_pending` is markup consumed on the
    way to a call that has not completed yet. A completed call drops `_pending`; a failed
    one turns it into content (`_fail`) and the buffer is read again from another state,
    so nothing the model wrote is ever lost."""

    def __init__(self) -> None:
        self._buf = ""
        self._pending = ""
        self._state = "text"
        self._scan = JsonEnd()
        self._index = 0
        self._out = Stripped()
        self._deltas: list[ToolCallDelta] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Content safe to emit now, and the deltas of the calls completed by this text."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of output: what was held back, decided now that nothing follows."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        while self._step(final):
            pass
        out, deltas = self._out.take(), self._deltas
        self._deltas = []
        return out, deltas

    def _step(self, final: bool) -> bool:
        """Decide what can be decided at the head of the buffer; True to be called again."""
        raise NotImplementedError

    def _take(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _hold(self, n: int, state: str) -> None:
        """The next n characters are markup, provisionally; go on in `state`."""
        self._pending += self._take(n)
        self._state = state
        if state in ("object", "array"):
            self._scan = JsonEnd()

    def _fail(self, state: str) -> None:
        """The held markup was not a call after all: it is content; reread from `state`."""
        self._content(self._pending)
        self._pending = ""
        self._state = state

    def _content(self, text: str) -> None:
        """Content out, stripped at both ends across all its pieces (the module's NOTE)."""
        self._out.add(text)

    def _emit(self, call: ToolCall) -> None:
        self._deltas.append(ToolCallDelta(self._index, id=call.id, name=call.name))
        self._deltas.append(ToolCallDelta(self._index, arguments=call.arguments))
        self._index += 1
        self._pending = ""

    def _text_until(self, tag: str, state: str, final: bool) -> bool:
        """Content up to `tag`, which is then held as markup; a possible partial tag at
        the end waits for more text."""
        i = self._buf.find(tag)
        if i >= 0:
            self._content(self._take(i))
            self._hold(len(tag), state)
            return True
        keep = 0 if final else partial_tag(self._buf, tag)
        self._content(self._take(len(self._buf) - keep))
        return False
