"""The request guards (server/guard.py): Host and Origin checks, JSON content type, body
size and time limits. Over a tiny Starlette app, without a model."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamer.config import ServerConfig
from streamer.server.guard import (
    HostCheck,
    JsonBody,
    default_hosts,
    host_name,
    is_json,
    is_loopback,
    name_allowed,
    origin_allowed,
)

# ---- the pure parts -----------------------------------------------------------------------


def test_loopback_binds_answer_loopback_names_only():
    for bind in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(bind) and default_hosts(bind) == ("localhost", "127.0.0.1", "[::1]")
    for bind in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback(bind) and default_hosts(bind) is None


@pytest.mark.parametrize(("host", "name"), [
    ("localhost:8000", "localhost"), ("LOCALHOST", "localhost"), ("127.0.0.1:1", "127.0.0.1"),
    ("[::1]:8000", "[::1]"), ("[::1]", "[::1]"), ("localhost.:80", "localhost"), ("evil.example", "evil.example"),
])
def test_host_name(host, name):
    assert host_name(host) == name


def test_name_allowed():
    loop = default_hosts("127.0.0.1")
    assert name_allowed("localhost", loop) and name_allowed("[::1]", loop)
    assert not name_allowed("evil.example", loop) and not name_allowed("localhost.evil.example", loop)
    assert name_allowed("anything", None) and name_allowed("anything", ["*"])
    assert name_allowed("api.example.com", ["*.example.com"]) and not name_allowed("example.com.evil", ["*.example.com"])
    assert name_allowed("example.com", ["Example.com"])


def test_origin_allowed():
    host = "127.0.0.1:8000"
    assert origin_allowed(None, host, None, False)  # not a browser
    assert origin_allowed("http://127.0.0.1:8000", host, None, False)  # the chat page: same origin
    assert origin_allowed("http://localhost:3000", host, None, True)  # a local page, bound to loopback
    assert not origin_allowed("http://localhost:3000", host, None, False)
    for bad in ("https://evil.example", "null", "file://", "http://127.0.0.1.evil.example:8000"):
        assert not origin_allowed(bad, host, None, True), bad
    assert origin_allowed("https://app.example.com", host, ["https://app.example.com/"], False)
    assert not origin_allowed("https://other.example.com", host, ["https://app.example.com"], False)
    assert origin_allowed("https://evil.example", host, ["*"], False)
    # bound publicly: a page of the server's own name is same-origin, another is not
    assert origin_allowed("https://llm.example.com", "llm.example.com", None, False)
    assert not origin_allowed("https://evil.example", "llm.example.com", None, False)


def test_is_json():
    assert is_json("application/json") and is_json("application/json; charset=utf-8") and is_json("Application/JSON")
    for ct in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
               "application/jsonx", "text/json"):
        assert not is_json(ct), ct


# ---- over ASGI ---------------------------------------------------------------------------


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


def make_app(**config) -> Starlette:
    cfg = ServerConfig(**config)
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/get", echo)])
    app.add_middleware(JsonBody, config=cfg, paths={"/echo"})
    app.add_middleware(HostCheck, config=cfg)
    return app


def call(app: Starlette, method: str, path: str, base: str = "http://127.0.0.1:8000", **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base) as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


JSON = {"content-type": "application/json"}


def error_of(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_foreign_host_is_421_on_loopback():
    app = make_app()
    assert call(app, "GET", "/get").status_code == 200
    assert call(app, "GET", "/get", base="http://localhost:1234").status_code == 200
    msg = error_of(call(app, "GET", "/get", base="http://evil.example:8000"), 421, "host_not_allowed")
    assert "evil.example" in msg and "--allowed-hosts" in msg
    assert call(make_app(allowed_hosts=("evil.example",)), "GET", "/get", base="http://evil.example").status_code == 200
    assert call(make_app(host="0.0.0.0"), "GET", "/get", base="http://anything.example").status_code == 200


def test_json_posts_need_a_json_content_type():
    app = make_app()
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        msg = error_of(call(app, "POST", "/echo", content=b"{}", headers={"content-type": ct}), 415,
                       "unsupported_media_type")
        assert "application/json" in msg
    assert call(app, "POST", "/echo", content=b"{}").status_code == 415  # none at all: fetch() of a Blob
    r = call(app, "POST", "/echo", content=b"{}", headers={"content-type": "application/json; charset=utf-8"})
    assert r.json() == {"bytes": 2}


def test_body_size_limit_from_content_length_and_while_reading():
    app = make_app(max_request_bytes=1000)
    assert call(app, "POST", "/echo", content=b"x" * 1000, headers=JSON).json() == {"bytes": 1000}
    msg = error_of(call(app, "POST", "/echo", content=b"x" * 1001, headers=JSON), 413, "request_too_large")
    assert "1,001 bytes" in msg and "1,000" in msg and "--max-request-bytes" in msg

    async def chunks():  # no Content-Length: cut off while reading
        for _ in range(100):
            yield b"x" * 100

    msg = error_of(call(app, "POST", "/echo", content=chunks(), headers=JSON), 413, "request_too_large")
    assert "--max-request-bytes" in msg


def test_a_slow_body_is_408():
    app = make_app(timeout_request_body=0.2)

    async def slow():
        yield b"{"
        await asyncio.sleep(1)
        yield b"}"

    r = call(app, "POST", "/echo", content=slow(), headers=JSON)
    assert "--timeout-request-body" in error_of(r, 408, "request_timeout")
    assert r.headers["connection"] == "close"


def test_websocket_origin_is_refused_before_accept():
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient, WebSocketDenialResponse
    from starlette.websockets import WebSocket

    async def ws_hello(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text("hello")
        await ws.close()

    app = Starlette(routes=[WebSocketRoute("/ws", ws_hello)])
    app.add_middleware(HostCheck, config=ServerConfig())
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    with client.websocket_connect("ws://127.0.0.1:8000/ws", headers={"origin": "http://127.0.0.1:8000"}) as ws:
        assert ws.receive_text() == "hello"
    with client.websocket_connect("ws://127.0.0.1:8000/ws") as ws:  # no Origin: not a browser
        assert ws.receive_text() == "hello"
    for origin in ("https://evil.example", "null"):
        with pytest.raises(WebSocketDenialResponse) as e, client.websocket_connect("ws://127.0.0.1:8000/ws", headers={"origin": origin}):
            pass
        assert e.value.status_code == 403 and "--allowed-origins" in e.value.json()["error"]["message"]
