"""streamer/sse.py: event data survives every character a model can emit, and the
readers split at CR / LF only, wherever the network cuts the bytes."""

from __future__ import annotations

import asyncio
import json

from streamer.sse import DONE, DONE_EVENT, aiter_lines, data_event, encode_data, iter_lines, parse_line

# characters str.splitlines (and so httpx's / requests' iter_lines) breaks lines at
TRICKY = "a\u2028b\u2029c\x85d\x0be\x1cf\nline\r\n\"q\" é 漢"


def stream_bytes() -> bytes:
    events = [encode_data({"text": TRICKY, "i": i}) for i in range(3)]
    return "".join(f"data: {e}\r\n\r\n" for e in events).encode() + b"data: [DONE]\n\n"


def cuts(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def parsed(lines) -> list:
    return [x for x in map(parse_line, lines) if x is not None]


def test_encoded_data_is_one_line_for_every_reader_and_decodes_to_the_text():
    data = encode_data({"text": TRICKY})
    assert len(data.splitlines()) == 1
    assert json.loads(data) == {"text": TRICKY}


def test_a_data_event_is_the_encoded_data_framed_as_bytes():
    body = {"text": TRICKY, "n": 1}
    assert data_event(body) == f"data: {encode_data(body)}\n\n".encode()
    assert parsed(iter_lines([data_event(body), DONE_EVENT])) == [body, DONE]


def test_lines_are_split_at_cr_and_lf_only_however_the_bytes_are_cut():
    want = [{"text": TRICKY, "i": i} for i in range(3)] + [DONE]
    data = stream_bytes()
    for size in (1, 2, 3, 7, 64, len(data)):  # cuts inside CRLF and inside UTF-8 characters
        assert parsed(iter_lines(cuts(data, size))) == want, size


def test_async_reader_gives_the_same_lines():
    async def chunks():
        for c in cuts(stream_bytes(), 5):
            yield c

    async def collect():
        return [line async for line in aiter_lines(chunks())]

    assert asyncio.run(collect()) == list(iter_lines([stream_bytes()]))


def test_a_raw_line_separator_in_data_would_cut_a_splitlines_reader():
    """Why the server escapes: unescaped, U+2028 splits the event for splitlines."""
    raw = 'data: {"text": "a\u2028b"}'
    assert len(raw.splitlines()) == 2
    assert parsed(iter_lines([raw.encode() + b"\n"])) == [{"text": "a\u2028b"}]


def test_named_events_read_back_each_events_name_and_data():
    from streamer.sse import named_events

    body = 'event: a\ndata: {"x": 1}\n\nevent: b\r\ndata: {"y": "\\u2028"}\r\n\r\n: ping\n\n'
    assert named_events(body) == [("a", {"x": 1}), ("b", {"y": "\u2028"})]
