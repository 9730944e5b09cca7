"""The benchmark's lean HTTP client: both body framings, errors, and connection reuse."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamer.bench.http import HTTPStatusError, StreamingClient


async def serve(handler):
    """A one-route HTTP/1.1 server on loopback; handler(body dict) -> raw response bytes."""
    connections = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            for part in handler(body):
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def chunked(events: list[bytes]) -> list[bytes]:
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    out += [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    return out + [b"0\r\n\r\n"]


def test_chunked_stream_arrives_whole_and_the_connection_is_reused():
    async def main():
        server, port, conns = await serve(
            lambda body: chunked([b"data: %d\n\n" % i for i in range(body["n"])] + [b"data: [DONE]\n\n"]))
        client = StreamingClient(f"http://127.0.0.1:{port}")
        for n in (3, 50):
            got = b"".join([p async for p in client.post_stream("/x", {"n": n})])
            assert got == b"".join(b"data: %d\n\n" % i for i in range(n)) + b"data: [DONE]\n\n"
        assert len(conns) == 1, "the second request reused the keep-alive connection"
        await client.aclose()
        server.close()

    asyncio.run(main())


def test_content_length_body_and_an_error_status():
    def handler(body):
        if body.get("bad"):
            msg = b'{"error": {"message": "max_tokens must be >= 1"}}'
            return [b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg)]
        return [b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello", b" world"]

    async def main():
        server, port, conns = await serve(handler)
        client = StreamingClient(f"http://127.0.0.1:{port}/")
        assert b"".join([p async for p in client.post_stream("/x", {})]) == b"hello world"
        with pytest.raises(HTTPStatusError, match="HTTP 400: .*max_tokens") as e:
            [p async for p in client.post_stream("/x", {"bad": True})]
        assert e.value.status == 400
        assert b"".join([p async for p in client.post_stream("/x", {})]) == b"hello world"
        await client.aclose()
        server.close()

    asyncio.run(main())


def test_a_stream_left_early_closes_its_connection():
    async def main():
        server, port, conns = await serve(lambda body: chunked([b"data: 1\n\n", b"data: 2\n\n"]))
        client = StreamingClient(f"http://127.0.0.1:{port}")
        gen = client.post_stream("/x", {})
        assert await anext(gen) == b"data: 1\n\n"
        await gen.aclose()  # the rest of the body is unread: the connection cannot be reused
        assert client.idle == []
        assert b"".join([p async for p in client.post_stream("/x", {})]) == b"data: 1\n\ndata: 2\n\n"
        assert len(conns) == 2
        await client.aclose()
        server.close()

    asyncio.run(main())
