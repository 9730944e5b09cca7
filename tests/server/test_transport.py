"""The HTTP protocol of `streamer serve` (server/transport.py): idle and slow connections are
closed, connections beyond the cap get 503, and secrets stay out of the logs. Over a tiny
app in a real uvicorn, without a model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from streamer.server.transport import RedactSecrets, guarded_http
from tests.conftest import serve_in_thread

TIMEOUT = 0.5
CAP = 8


async def hello(request: Request) -> PlainTextResponse:
    await asyncio.sleep(float(request.query_params.get("sleep", 0)))
    return PlainTextResponse("hello")


async def size(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


@pytest.fixture(scope="module")
def url():
    app = Starlette(routes=[Route("/", hello), Route("/size", size, methods=["POST"])])
    with serve_in_thread(app, http=guarded_http(TIMEOUT, CAP), timeout_keep_alive=TIMEOUT) as (port, _loop):
        yield f"http://127.0.0.1:{port}"


def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def closed_after(s: socket.socket, limit: float = 5.0) -> float:
    """Seconds until the server closes s (reading and dropping what it sends)."""
    t0 = time.monotonic()
    s.settimeout(limit)
    while s.recv(4096):
        pass
    return time.monotonic() - t0


def test_a_connection_that_sends_nothing_is_closed(url):
    with raw(url) as s:
        assert TIMEOUT * 0.8 < closed_after(s) < TIMEOUT + 1


def test_a_head_sent_byte_by_byte_is_cut_off(url):
    """Slowloris: every byte is news to uvicorn's own timer, not to the head timer."""
    head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    with raw(url) as s:
        t0 = time.monotonic()
        with pytest.raises(OSError):  # reset or broken pipe, once the server has closed it
            for b in head:
                s.send(bytes([b]))
                time.sleep(0.02)
                assert time.monotonic() - t0 < TIMEOUT + 1, "the connection is still open"
        assert time.monotonic() - t0 > TIMEOUT * 0.8


def test_a_huge_head_is_431_and_a_huge_body_is_not(url):
    with raw(url) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        with pytest.raises(OSError):  # cut off at 64 KiB (plus one read)
            for _ in range(100):
                s.sendall(b"a" * 65536)
        s.settimeout(5)
        with contextlib.suppress(OSError):  # (the reset may have eaten it)
            answer = s.recv(4096)
            assert not answer or answer.startswith(b"HTTP/1.1 431"), answer
    r = httpx.post(url + "/size", content=b"x" * (8 << 20), headers={"X-Ok": "a" * 8000}, timeout=30)
    assert r.status_code == 200 and r.text == str(8 << 20)
    body = b"x" * 120_000  # a head and its body in one read, again and again on one connection
    with raw(url) as s:
        s.settimeout(5)
        for _ in range(3):
            s.sendall(b"POST /size HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            answer = b""
            while not answer.endswith(b"\r\n\r\n120000"):
                chunk = s.recv(4096)
                assert chunk, answer  # closed: the head and body were taken for one endless head
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer


def test_keep_alive_then_idle_is_closed_and_slow_responses_are_not(url):
    with raw(url) as s:
        s.sendall(b"GET /?sleep=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # longer than the head timeout
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        assert closed_after(s) < TIMEOUT + 1


def test_connections_beyond_the_cap_get_503_and_later_ones_are_served(url):
    idle = [raw(url) for _ in range(CAP)]
    try:
        time.sleep(0.1)
        with raw(url) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            s.settimeout(5)
            answer = s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the idle ones are gone: service again
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_secrets_are_redacted_from_log_records():
    f = RedactSecrets()
    rec = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                            ("1.2.3.4:5", "GET", "/v1/chat/ws?x=1&api_key=sk-secret&y=2", "1.1", 200), None)
    assert f.filter(rec) and "sk-secret" not in rec.getMessage() and "api_key=***&y=2" in rec.getMessage()
    rec = logging.LogRecord("uvicorn.error", logging.INFO, "", 0, "GET /?token=abc", None, None)
    assert f.filter(rec) and rec.getMessage() == "GET /?token=***"
