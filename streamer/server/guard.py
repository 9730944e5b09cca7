"""What every request passes before a route sees it: who may call (HostCheck, ApiKeyCheck)
and what a JSON route reads (JsonBody). All are pure ASGI middleware, so that streams pass
untouched.

HostCheck — a web page the user visits must not drive a server on their machine:
  * DNS rebinding: evil.example resolves to 127.0.0.1, and the page's requests reach the
    local server with `Host: evil.example`. Bound to a loopback address, the server only
    answers Host names that are loopback names (or --allowed-hosts): 421 otherwise.
  * Cross-site WebSockets: browsers apply no same-origin rule to WebSockets, they only
    send `Origin`. A handshake whose Origin is neither the server's own origin (the chat
    page) nor allowed (--allowed-origins; loopback pages when bound to loopback) is refused
    with 403 before it is accepted. Clients that are not browsers send no Origin.
  * Cross-site POSTs need no check of their own: a page can only send text/plain, form or
    multipart bodies without a CORS preflight (which this server never grants), and JsonBody
    answers those 415.

ApiKeyCheck — with --api-key, the PROTECTED paths over HTTP need one of the keys; the
  WebSocket checks the key itself (websocket.py), with the helpers here.

JsonBody — a JSON POST route gets its body whole, read here under two limits: at most
max_request_bytes (413, from Content-Length before reading anything, or as soon as a
chunked body passes it) and within timeout_request_body of the head (408). Unknown
routes and other methods pass untouched (Starlette answers 404 / 405).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Collection
from urllib.parse import urlsplit

import msgspec
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from streamer.config import ServerConfig
from streamer.server.protocol import ApiError

log = logging.getLogger("streamer.server")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def error_response(err: ApiError, close: bool = False) -> Response:
    headers = {**(err.headers or {}), **({"Connection": "close"} if close else {})}
    return Response(msgspec.json.encode(err.body()), err.status, headers=headers, media_type="application/json")


# ---- Host and Origin ------------------------------------------------------------------------


def is_loopback(bind: str) -> bool:
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def default_hosts(bind: str) -> tuple[str, ...] | None:
    """The Host names answered when --allowed-hosts is not given (None: any)."""
    return LOOPBACK_NAMES if is_loopback(bind) else None


def host_name(host: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '[::1]' (a trailing dot dropped)."""
    host = host.strip().lower()
    name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    return name.rstrip(".")


def name_allowed(name: str, allowed: Collection[str] | None) -> bool:
    """allowed: exact names, "*" for any, "*.example.com" for its subdomains; None: any."""
    if allowed is None:
        return True
    for a in allowed:
        a = a.lower()
        if a == "*" or a == name or (a.startswith("*.") and name.endswith(a[1:])):
            return True
    return False


def origin_allowed(origin: str | None, host: str | None, allowed: Collection[str] | None,
                   loopback_pages: bool) -> bool:
    """A WebSocket handshake's Origin: none (not a browser), the Host's own origin, one of
    `allowed` ("*" for any; full origins such as "https://app.example.com"), or, with
    loopback_pages, any page served from a loopback name."""
    if origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    if allowed is not None and ("*" in allowed or origin in {a.lower().rstrip("/") for a in allowed}):
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed frames, file://) and other schemes
    if host is not None and parts.netloc == host.strip().lower():
        return True
    return loopback_pages and host_name(parts.netloc) in LOOPBACK_NAMES


class HostCheck:
    """Pure ASGI: the Host of every request, and the Origin of WebSocket handshakes."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.hosts = config.allowed_hosts if config.allowed_hosts is not None else default_hosts(config.host)
        self.origins = config.allowed_origins
        self.loopback_pages = config.allowed_origins is None and is_loopback(config.host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        why = code = None
        if host is not None and not name_allowed(host_name(host), self.hosts):
            # (no Host at all: HTTP/1.0, never a browser)
            why, code = f"the Host {host!r} is not served here (streamer serve --allowed-hosts)", "host_not_allowed"
        elif scope["type"] == "websocket" and not origin_allowed(headers.get("origin"), host, self.origins,
                                                                 self.loopback_pages):
            why = f"the Origin {headers.get('origin')!r} may not open a WebSocket here (streamer serve --allowed-origins)"
            code = "origin_not_allowed"
        if why is None:
            await self.app(scope, receive, send)
            return
        log.warning("refused %s %s: %s", scope["type"], scope["path"], why)
        if scope["type"] == "http":
            await error_response(ApiError(why, 421, code=code))(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await error_response(ApiError(why, 403, code=code))(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008})  # before accept: the server answers 403


# ---- API keys -------------------------------------------------------------------------------

PROTECTED = ("/v1/", "/generate", "/tokenize", "/detokenize", "/apply_chat_template", "/invocations")
"""Paths that need the API key when one is set."""

KEY_ID = "streamer.key_id"
"""Scope entry: the hash of the API key a request authenticated with (ServerState.apply_policy)."""


class ApiKeyCheck:
    """Pure ASGI: the PROTECTED paths over HTTP need `Authorization: Bearer <key>` (or Anthropic's
    `x-api-key: <key>`), one of the keys, when keys are set; the hash of the key goes to scope[KEY_ID] (per-key cache isolation).

    The WebSocket checks the key itself (browsers cannot set headers on a
    WebSocket, so it also takes ?api_key=).
    """

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.config.api_keys
        if keys and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            headers = dict(scope["headers"])
            given = bearer(headers.get(b"authorization", b"").decode("latin-1"))
            if given is None and b"x-api-key" in headers:  # (Anthropic's clients send the key so)
                given = headers[b"x-api-key"].decode("latin-1").strip()
            key = matching_key(keys, given)
            if key is None:
                err = ApiError("missing or wrong API key (send Authorization: Bearer <key>, or x-api-key)", 401,
                               code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
            scope[KEY_ID] = key_id(key)
        await self.app(scope, receive, send)


def bearer(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header value."""
    scheme, _, given = authorization.partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def matching_key(keys: tuple[str, ...], given: str | None) -> str | None:
    """The key equal to `given`, or None; every key is compared, each in constant time."""
    found = None
    for key in keys:
        if given is not None and hmac.compare_digest(given.encode(), key.encode()):
            found = key
    return found


def key_id(key: str) -> str:
    """What identifies a key's tenant in cache salts (never the key itself): 16 hex digits."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


# ---- JSON bodies ----------------------------------------------------------------------------


def is_json(content_type: str | None) -> bool:
    """application/json, with parameters (charset) or not."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


class JsonBody:
    """Pure ASGI: POSTs to `paths` must be application/json, and their body arrive whole,
    within the size and time limits, before the route runs (it then reads it from memory)."""

    def __init__(self, app: ASGIApp, config: ServerConfig, paths: Collection[str]) -> None:
        self.app, self.paths = app, frozenset(paths)
        self.max_bytes, self.timeout = config.max_request_bytes, config.timeout_request_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not is_json(headers.get("content-type")):
            err = ApiError(f"send the body as JSON with Content-Type: application/json "
                           f"(got {headers.get('content-type')!r})", 415, code="unsupported_media_type")
            await error_response(err)(scope, receive, send)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(self.too_large(int(length)))(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await self.read(receive)
        except TimeoutError:
            err = ApiError(f"the body did not arrive within {self.timeout:g} s "
                           "(streamer serve --timeout-request-body)", 408, code="request_timeout")
            await error_response(err, close=True)(scope, receive, send)
            return
        if body is None:
            return  # the client went away
        if isinstance(body, ApiError):
            # (the connection stays open: uvicorn reads and drops the rest of the body, so that
            # the client gets to read this answer; a client that never stops sending is cut off by
            # transport.py's head timer, which runs from this response on)
            await error_response(body)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def read(self, receive: Receive) -> bytes | ApiError | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return self.too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def too_large(self, length: int | None) -> ApiError:
        size = f" ({length:,} bytes)" if length is not None else ""
        return ApiError(f"the body{size} is larger than the limit of {self.max_bytes:,} bytes "
                        "(streamer serve --max-request-bytes)", 413, code="request_too_large")
