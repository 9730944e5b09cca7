"""Server-Sent Events framing in one place: the JSON of a `data:` field (server side)
and reading `data:` lines back (benchmarks, the language's HTTP backend, the
locustfile, tests).

SSE lines end at CR, LF or CRLF only. Python's str.splitlines also breaks at U+2028,
U+2029, U+0085 and a few control characters, and readers built on it (httpx's
iter_lines, requests' iter_lines) cut an event whose text holds one of them; a model
can emit any of these. So the server escapes them in its JSON (valid JSON either way),
and the readers here split at CR / LF only.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import msgspec

DONE = "[DONE]"
"""What parse_line returns for the stream's end marker."""

_EOL = re.compile(rb"\r\n|\r|\n")
# line breaks for str.splitlines that JSON leaves unescaped (C0 controls are escaped)
_SPLITLINES_ONLY = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}


def encode_data(body: Any) -> str:
    """The JSON text of one event's data, safe for splitlines-based readers."""
    text = msgspec.json.encode(body).decode()
    for raw, escaped in _SPLITLINES_ONLY.items():
        if raw in text:
            text = text.replace(raw, escaped)
    return text


_SPLITLINES_ONLY_UTF8 = [(raw.encode(), escaped.encode()) for raw, escaped in _SPLITLINES_ONLY.items()]
DONE_EVENT = b"data: [DONE]\n\n"


def data_event(body: Any) -> bytes:
    """A whole `data: <JSON>` event, framed and encoded: what encode_data gives, as bytes
    (the hot path of streaming: one per token per stream, no str round trip)."""
    data = msgspec.json.encode(body)
    for raw, escaped in _SPLITLINES_ONLY_UTF8:  # (UTF-8 is self-synchronizing: a byte match is a match)
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def parse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON of a `data: {...}` line, DONE for `data: [DONE]`, None for any other line
    (blank separators, comments, other fields)."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    return DONE if data == DONE else json.loads(data)


def named_events(body: str) -> list[tuple[str, Any]]:
    """The (name, data) of each event of a whole SSE body whose events are named (`event:`
    then `data:`, as /v1/responses and /v1/messages stream them)."""
    out = []
    for block in re.split(r"\r\n\r\n|\n\n|\r\r", body):
        lines = _EOL.split(block.encode())
        name = next((ln[len(b"event: "):].decode() for ln in lines if ln.startswith(b"event: ")), "")
        data = next((parse_line(ln.decode()) for ln in lines if ln.startswith(b"data: ")), None)
        if name or data is not None:
            out.append((name, data))
    return out


class _Splitter:
    def __init__(self) -> None:
        self.rest = b""

    def feed(self, data: bytes) -> list[str]:
        # a CRLF cut between two reads yields one extra blank line: a no-op for readers
        *lines, self.rest = _EOL.split(self.rest + data)
        return [line.decode("utf-8", errors="replace") for line in lines]


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of a byte stream (e.g. requests' iter_content(None))."""
    splitter = _Splitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    if splitter.rest:
        yield splitter.rest.decode("utf-8", errors="replace")


async def aiter_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The lines of an async byte stream (e.g. httpx's Response.aiter_bytes())."""
    splitter = _Splitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    if splitter.rest:
        yield splitter.rest.decode("utf-8", errors="replace")
