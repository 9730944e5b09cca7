"""OpenAI's "harmony" output format (gpt-oss): the markers, and its messages read as they stream.

A gpt-oss completion (the prompt ends with `<|start|>assistant`) is a run of messages:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

or, for a tool call, `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>` (the recipient may stand before the channel instead:
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). A message's
header runs from its start (the output's start, or `<|start|>`) to `<|message|>`; its body
from there to `<|end|>`, `<|return|>` or `<|call|>` (the last two are EOS tokens: they may
be missing at the end of the output), or to the next `<|start|>`.

The markers are special tokens of the gpt-oss tokenizer, so the detokenizer must keep
them (HARMONY_MARKERS, SamplingParams.keep_special_tokens); the consumers are the
reasoning parser "openai_gptoss" (reasoning.py) and the tool-call parser "openai"
(tool_parsers.py), which read the same events of one `HarmonyReader`.

Text outside any message (an output without markers: another model, or a template that
did not ask for harmony) is reported as text, verbatim: nothing the model wrote is lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from streamer.chat_template import HARMONY_CHANNEL as CHANNEL
from streamer.server.text_pieces import partial_tag

START, END, MESSAGE, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_MARKERS: tuple[str, ...] = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
"""The special tokens that structure a harmony output (gpt-oss ids 200006, 200007, 200008,
200005, 200003, 200002, 200012): the detokenizer keeps their text for the parsers."""
TERMINATORS = (END, RETURN, CALL)
"""What ends a message's body (as does the next START)."""
_BODY_ENDS = (*TERMINATORS, START)
_OPENERS = (START, CHANNEL)
"""Where a message begins after text or another message."""
_FIRST_OPENERS = (*HARMONY_MARKERS, "to=")
"""Where the output's first message may begin (its `<|start|>assistant` is in the prompt)."""
MAX_HEADER = 256
"""A header longer than this (no `<|message|>` yet) was not one: it is text."""

_RECIPIENT = re.compile(r"(?:^|\s|>)to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_CONTENT_TYPE = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)|(?:^|\s)(json|code)(?=\s*(?:<\||$))")


@dataclass(frozen=True)
class Header:
    """One message's header. raw: its text between the opener and `<|message|>` as written
    (for a message opened by `<|start|>`, without it; e.g. "assistant<|channel|>final")."""

    raw: str
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def function(self) -> str | None:
        """The function called, for a message to `functions.NAME`."""
        if self.recipient is not None and self.recipient.startswith("functions.") and len(self.recipient) > 10:
            return self.recipient[len("functions."):]
        return None


def parse_header(raw: str) -> Header:
    channel = _CHANNEL.search(raw)
    recipient = _RECIPIENT.search(raw)
    ctype = _CONTENT_TYPE.search(raw)
    return Header(raw, channel.group(1) if channel else None, recipient.group(1) if recipient else None,
                  (ctype.group(1) or ctype.group(2)) if ctype else None)


@dataclass(frozen=True)
class Text:
    """Text outside any message, verbatim."""

    text: str


@dataclass(frozen=True)
class Open:
    """A message's header is complete. opener: START, or "" where the message began without
    one (the output's first, whose `<|start|>assistant` is in the prompt)."""

    header: Header
    opener: str


@dataclass(frozen=True)
class Body:
    text: str


@dataclass(frozen=True)
class Close:
    """The end of the open message: its terminator as written ("" where the output ended,
    or the next `<|start|>` began, without one)."""

    terminator: str


Event = Text | Open | Body | Close


class HarmonyReader:
    """The messages of one output as it streams: feed() each piece, finish() at the end;
    each returns the events decided so far. A possible partial marker at the end of the text
    is held back until decided (at finish() it is text, or the body's)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "first"  # first -> header | text; header -> body; body -> text | header
        self._opener = ""  # START, or "" for a header that began without one
        self._events: list[Event] = []

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        while self._step(final):
            pass
        out, self._events = self._events, []
        return out

    def _take(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _text(self, text: str) -> None:
        if text:
            self._events.append(Text(text))

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "first":
            rest = buf.lstrip()
            if not final and (not rest or any(m.startswith(rest) and m != rest for m in _FIRST_OPENERS)):
                return False  # nothing yet, or what may still become a marker
            if rest.startswith(START):
                self._take(len(buf) - len(rest) + len(START))
                self._opener, self._state = START, "header"
            elif rest.startswith(_FIRST_OPENERS):
                self._opener, self._state = "", "header"
            else:
                self._state = "text"
            return True
        if self._state == "text":
            hits = [(i, m) for m in _OPENERS if (i := buf.find(m)) >= 0]
            if hits:
                i, m = min(hits)
                self._text(self._take(i))
                if m == START:
                    self._take(len(START))
                self._opener, self._state = (START if m == START else ""), "header"
                return True
            keep = 0 if final else max(partial_tag(buf, m) for m in _OPENERS)
            self._text(self._take(len(buf) - keep))
            return False
        if self._state == "header":
            hits = [(j, m) for m in (MESSAGE, *_BODY_ENDS) if (j := buf.find(m)) >= 0]
            i, m = min(hits) if hits else (-1, "")
            # (decided alike however the text is split: a header is at most MAX_HEADER long,
            # which is known once a marker there would have shown whole)
            if (i < 0 and len(buf) >= MAX_HEADER + len(MESSAGE)) or i > MAX_HEADER or (i >= 0 and m != MESSAGE):
                n = i if 0 <= i <= MAX_HEADER else MAX_HEADER + 1
                self._text(self._opener + self._take(n))  # it was not a header
                self._state = "text"
                return True
            if i < 0:
                if not final:
                    return False
                raw = self._take(len(buf))
                if not self._opener and not any(m in raw for m in HARMONY_MARKERS):
                    self._text(raw)  # (plain text that began like "to=...")
                # else: a header cut off by the end of the output: markup without text
                return False
            raw = self._take(i)
            self._take(len(MESSAGE))
            self._events.append(Open(parse_header(raw), self._opener))
            self._state = "body"
            return True
        # "body"
        hits = [(i, m) for m in _BODY_ENDS if (i := buf.find(m)) >= 0]
        if hits:
            i, m = min(hits)
            if i:
                self._events.append(Body(self._take(i)))
            if m == START:
                self._events.append(Close(""))
                self._state = "text"  # (which opens the next header at the START)
            else:
                self._take(len(m))
                self._events.append(Close(m))
                self._state = "text"
            return True
        keep = 0 if final else max(partial_tag(buf, m) for m in _BODY_ENDS)
        if len(buf) > keep:
            self._events.append(Body(self._take(len(buf) - keep)))
        if final:
            self._events.append(Close(""))
            self._state = "text"
        return False


def verbatim_open(event: Open, start: bool = False) -> str:
    """A message's opening as markup again: as written, or (start) always with its
    `<|start|>`, so that another reader of the text finds it wherever it stands."""
    return (START if start else event.opener) + event.header.raw + MESSAGE
