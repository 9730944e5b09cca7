"""A lean HTTP/1.1 client for streaming POSTs, so that the benchmark client measures the
server and not itself.

httpx spent about 2 ms of Python per request on the way out and in (measured by a
stage-by-stage TTFT probe, since removed: 1.7 ms from send to the server's handler, 1.1 ms
from the SSE event to its parse, against 0.5 and 0.2 ms for a raw socket), a tenth of a good
time to first token, and at saturation its parsing of ~5k SSE events/s took half a core.
This client writes the request in one send and reads the body straight off the stream:
chunked or Content-Length framing, keep-alive connections reused from a pool.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    """A response other than 200; the message holds the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body.decode(errors='replace')[:200]}")
        self.status = status


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class StreamingClient:
    """POST JSON and iterate over the response body's bytes as they arrive."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 1800.0) -> None:
        self.timeout = timeout
        """Per request, for callers to apply around their reading (asyncio.timeout)."""
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, not {base_url!r}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = f"Host: {u.netloc}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
        self.idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        while self.idle:
            c = self.idle.pop()
            if not c.reader.at_eof() and not c.writer.is_closing():
                return c
            c.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return _Conn(reader, writer)

    async def post_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """The body of a 200 response, piece by piece; raises HTTPStatusError otherwise."""
        data = json.dumps(body, separators=(",", ":")).encode()
        conn = await self._connect()
        done = False
        try:
            conn.writer.write(
                f"POST {self.prefix}{path} HTTP/1.1\r\n{self.head}Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            status, headers = await self._read_head(conn.reader)
            if status != 200:
                raise HTTPStatusError(status, b"".join([p async for p in self._body(conn.reader, headers)]))
            async for piece in self._body(conn.reader, headers):
                yield piece
            done = headers.get("connection", "").lower() != "close"
        finally:
            if done:
                self.idle.append(conn)  # the body was read to its end: the connection is reusable
            else:
                conn.close()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ConnectionError(f"not an HTTP/1.x response: {lines[0]!r}")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    @staticmethod
    async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                piece = await reader.readexactly(size + 2)
                yield piece[:-2]
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                piece = await reader.read(min(left, 1 << 16))
                if not piece:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(piece)
                yield piece
        else:
            while piece := await reader.read(1 << 16):
                yield piece
            headers["connection"] = "close"

    async def aclose(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()
