"""`streamer router --worker URL ...`: one endpoint in front of separate `streamer serve` hosts.

The same RoutingPolicy as `serve --data-parallel-size` (router/policy.py), over HTTP: each
request's routing key is its JSON body's prompt or messages as text (router/keys.py says
why text: the router holds no tokenizer and asks no worker to tokenize), and it goes, whole,
to one worker; the worker's answer (JSON, or an SSE stream, chunk by chunk as it comes)
goes back unchanged. Routed: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings,
/v1/messages (and its count_tokens), and the native API's
POSTs (/generate, /tokenize, /detokenize, /apply_chat_template); /v1/models and /version go
to the least loaded worker; the WebSocket chat /v1/chat/ws is relayed frame by frame to one
worker for the whole session (the session sticks: the worker keeps the conversation).

Failure: a worker whose connection fails before the request is sent is marked down and the
request goes to the next one; every worker down: 503. A worker that fails mid-answer ends
that answer (the client sees the stream end). The router checks no API key (the workers
do: Authorization and ?api_key pass through) and keeps no state but its trees and counts.
/health: 200 while a worker is up ("degraded" while some are down), else 503, with each
worker's status; /metrics: the router's own (router/metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from streamer.config import BALANCE_MARGIN
from streamer.router.keys import body_key
from streamer.router.metrics import RouterCollector
from streamer.router.policy import NoReplica, RoutingPolicy
from streamer.router.workers import WorkerPool, worker_urls

ROUTED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/messages",
          "/v1/messages/count_tokens", "/generate", "/tokenize", "/detokenize",
          "/apply_chat_template")
ANY = ("/v1/models", "/version")
PASSED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type", "accept", "x-request-id")
DROPPED_ANSWER_HEADERS = ("connection", "transfer-encoding", "content-length", "keep-alive", "date", "server")
CONNECT_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8 << 20
"""As `streamer serve`'s default: the router holds a body whole before it sends it on."""


class _Router:
    def __init__(self, urls: list[str], margin: int, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes
        self.policy = RoutingPolicy(len(urls), margin)
        self.pool = WorkerPool(urls, self.policy)
        self.client: httpx.AsyncClient | None = None

    def _pick(self, key: str, tried: set[int]) -> int:
        usable = [ok and i not in tried for i, ok in enumerate(self.pool.usable())]
        return self.policy.route(key, usable=usable)

    async def forward(self, request: Request) -> Response:
        assert self.client is not None
        body = await self._body(request)
        if body is None:
            return JSONResponse({"error": {"message": f"the request body is over {self.max_request_bytes:,} bytes "
                                           "(streamer router --max-request-bytes)", "type": "invalid_request_error",
                                           "code": "limit_exceeded"}}, 413)
        try:
            key = body_key(request.url.path, json.loads(body)) if body else ""
        except ValueError:
            key = ""  # (the worker answers the bad JSON)
        headers = {k: v for k, v in request.headers.items() if k in PASSED_HEADERS}
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[int] = set()
        while True:
            try:
                i = self._pick(key, tried)
            except NoReplica:
                return _unavailable(self.pool.status())
            worker = self.pool.workers[i]
            upstream = self.client.build_request(request.method, worker.url + path, content=body, headers=headers)
            try:
                answer = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # not sent: another worker may take it
                worker.mark_down(f"{type(e).__name__}: {e}")
                tried.add(i)
                continue
            except httpx.HTTPError as e:
                return JSONResponse({"error": {"message": f"worker {worker.url} failed: {e}", "type": "server_error",
                                               "code": "worker_error"}}, 502)
            break
        worker.requests += 1
        self.policy.open(i)
        kept = {k: v for k, v in answer.headers.items() if k not in DROPPED_ANSWER_HEADERS}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.HTTPError:
                pass  # the worker went away mid-answer: the answer ends here

        async def done() -> None:
            await answer.aclose()
            self.policy.close(i)

        # (the background task runs after the answer, and also when the client goes away)
        return StreamingResponse(relay(), status_code=answer.status_code, headers=kept, background=BackgroundTask(done))

    async def _body(self, request: Request) -> bytes | None:
        """The body, read whole (its prompt decides the worker), or None past max_request_bytes."""
        if int(request.headers.get("content-length") or 0) > self.max_request_bytes:
            return None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                return None
        return bytes(body)

    async def session(self, ws: WebSocket) -> None:
        origin = ws.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != ws.headers.get("host"):
            await ws.close(1008, "a WebSocket from another origin")  # (a foreign page's browser)
            return
        headers = {k: v for k, v in ws.headers.items() if k == "authorization"}
        query = f"?{ws.url.query}" if ws.url.query else ""
        tried: set[int] = set()
        while True:
            try:
                i = self._pick("", tried)
            except NoReplica:
                await ws.close(1013, "no worker is available")
                return
            worker = self.pool.workers[i]
            url = "ws" + worker.url[len("http"):] + ws.url.path + query
            try:
                upstream = await connect(url, additional_headers=headers, open_timeout=CONNECT_TIMEOUT_S,
                                         ping_interval=None, max_size=None)
            except (OSError, TimeoutError, WebSocketException) as e:
                worker.mark_down(f"WebSocket: {type(e).__name__}: {e}")
                tried.add(i)
                continue
            break
        worker.requests += 1
        self.policy.open(i)
        await ws.accept()
        try:
            await _relay(ws, upstream)
        finally:
            self.policy.close(i)
            await upstream.close()

    def health(self, request: Request) -> Response:
        status = self.pool.status()
        up = sum(w["status"] == "ok" for w in status)
        if not up:
            return _unavailable(status)
        return JSONResponse({"status": "ok" if up == len(status) else "degraded", "workers": status})


async def _relay(ws: WebSocket, upstream: Any) -> None:
    """Frames both ways until either side closes; the other side is then closed with its code."""
    async def up() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            await upstream.send(msg["text"] if msg.get("text") is not None else msg["bytes"])

    async def down() -> None:
        try:
            async for frame in upstream:
                await (ws.send_text(frame) if isinstance(frame, str) else ws.send_bytes(frame))
        except ConnectionClosed:
            pass
        close = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await ws.close(close if close != 1006 else 1011, upstream.close_reason or "")

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except WebSocketDisconnect:
        pass
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _unavailable(status: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"status": "error", "error": {"message": "no worker is available", "type": "server_error",
                                                      "code": "unavailable"}, "workers": status},
                        503, headers={"Retry-After": "5"})


def create_router_app(urls: list[str], margin: int = BALANCE_MARGIN, max_request_bytes: int = MAX_REQUEST_BYTES,
                      ) -> Starlette:
    router = _Router(worker_urls(urls), margin, max_request_bytes)
    registry = CollectorRegistry()
    workers = router.pool.workers
    registry.register(RouterCollector(router.policy, "worker", [w.url for w in workers], router.pool.usable,
                                      lambda: [w.requests for w in workers]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)  # (answers stream for as long as they take)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            router.client = client
            await router.pool.check(client)
            watch = asyncio.create_task(router.pool.watch(client), name="streamer-router-watch")
            try:
                yield
            finally:
                watch.cancel()

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [Route("/health", router.health), Route("/metrics", metrics),
              *(Route(p, router.forward, methods=["POST"]) for p in ROUTED),
              *(Route(p, router.forward) for p in ANY), Route("/v1/models/{model:path}", router.forward),
              WebSocketRoute("/v1/chat/ws", router.session)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    return app


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", dest="workers", action="append", default=[], metavar="URL", required=True,
                   help="a `streamer serve` host, e.g. http://10.0.0.2:8000 (repeat for each)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--balance-margin", type=int, default=BALANCE_MARGIN, metavar="REQUESTS",
                   help="open requests by which the worker holding a prompt's prefix may exceed the least "
                        f"loaded worker and still get it (default {BALANCE_MARGIN})")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="BYTES",
                   help=f"bytes of an HTTP body; beyond it 413 (default {MAX_REQUEST_BYTES:,}); WebSocket "
                        "messages are the workers' to limit")


def run_router(args: argparse.Namespace) -> None:
    import logging  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = create_router_app(args.workers, args.balance_margin, args.max_request_bytes)
    print(f"streamer router: http://{args.host}:{args.port} in front of {', '.join(args.workers)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", ws_ping_interval=20)
