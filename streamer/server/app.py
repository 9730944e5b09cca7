"""The Starlette app: routes, API key check, the bridge to the engine, and `streamer serve`.

ServerState is the one place where HTTP and WebSocket handlers meet the
engine: it admits requests (queue limit, draining), fans a request out into
engine requests, tracks which engine requests are in flight (so a shutdown
can abort them all and every stream still gets its final chunk), and feeds
the metrics.

Shutdown order under `streamer serve` (SIGTERM / SIGINT, handled by uvicorn):
  1. stop accepting; new requests would get 503 (draining);
  2. abort every in-flight engine request: each stream ends with a final
     chunk (finish_reason "abort") and [DONE], each WebSocket turn with done;
  3. uvicorn waits for the connections to finish, then the lifespan stops the engine
     (by default an EngineProcess: Stop, then the process is joined).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from streamer import __version__
from streamer.config import EngineConfig, ServerConfig
from streamer.errors import RequestError
from streamer.messages import GenerateRequest, RequestOutput
from streamer.server import native_api, openai_api, websocket
from streamer.server.metrics import Metrics, RequestCounter, RequestTimer
from streamer.server.protocol import ApiError, openapi_document

log = logging.getLogger("streamer.server")
STATIC = Path(__file__).parent / "static"


PROTECTED = ("/v1/", "/generate", "/tokenize", "/apply_chat_template")
"""Paths that need the API key when one is set."""


class ServerState:
    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = Metrics(engine.stats)
        self.inflight: set[str] = set()
        self.pending = 0
        """Engine requests submitted that have not produced their first output yet."""
        self.draining = False

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.engine.model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.engine.model_name):
            raise ApiError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def admit(self, n: int) -> None:
        """Refuse (503) while draining, when the engine is down, or when the queue is full.

        The queue is what waits for a first token. A request is refused when
        something already waits and taking it would exceed max_queue.
        """
        if self.draining or self.engine.dead:
            why = "the server is shutting down" if self.draining else f"the engine is down: {self.engine.dead}"
            raise ApiError(why, 503, type="server_error", code="unavailable", headers={"Retry-After": "5"})
        depth = max(self.pending, self.engine.stats().waiting)
        if depth and depth + n > self.config.max_queue:
            raise ApiError(f"the server is busy ({depth} requests waiting); retry later", 503,
                           type="server_error", code="queue_full", headers={"Retry-After": "1"})

    async def fit_to_context(self, req: GenerateRequest) -> GenerateRequest:
        """max_tokens omitted: tokenize here (off the loop) and allow the room left in the context."""
        try:
            ids = await asyncio.to_thread(self.engine.tokenizer.encode_prompt, req)
        except RequestError as e:
            raise ApiError(str(e)) from None
        pool_tokens = self.engine.stats().pages_total * self.engine.config.page_size
        room = min(self.engine.max_model_len, pool_tokens) - len(ids)
        if room < 1:
            raise ApiError(f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                           f"the prompt has {len(ids)} tokens", param="messages", code="context_length_exceeded")
        params = msgspec.structs.replace(req.params, max_tokens=room)
        return GenerateRequest(request_id=req.request_id, prompt_token_ids=ids, params=params)

    async def stream(self, reqs: list[GenerateRequest]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run the engine requests concurrently; yield (index, output) as they come.

        Closing this iterator (or cancelling its consumer) cancels the pumps,
        which closes each engine iterator and so aborts its request.
        """
        if len(reqs) == 1:
            # the usual case: the engine's iterator runs in the consumer's task, with no pump
            # task and queue hop per token
            req = reqs[0]
            timer, waiting = RequestTimer(self.metrics), True
            self.pending += 1
            self.inflight.add(req.request_id)
            outputs = self.engine.submit(req)
            try:
                while True:
                    try:
                        out = await anext(outputs)
                    except StopAsyncIteration:
                        return
                    except Exception as e:  # noqa: BLE001 - the engine's failure, as the pumps report it
                        raise ApiError(f"the engine failed: {e}", 503, type="server_error", code="engine_error") from e
                    if waiting:
                        self.pending, waiting = self.pending - 1, False
                    timer.observe(out)
                    yield 0, out
            finally:
                await outputs.aclose()  # before the end: aborts the engine request
                if waiting:
                    self.pending -= 1
                timer.abandoned()
                self.inflight.discard(req.request_id)
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self.pending += len(reqs)
        self.inflight.update(r.request_id for r in reqs)

        async def pump(i: int, req: GenerateRequest) -> None:
            timer, waiting = RequestTimer(self.metrics), True
            try:
                async for out in self.engine.submit(req):
                    if waiting:
                        self.pending, waiting = self.pending - 1, False
                    timer.observe(out)
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                if waiting:
                    self.pending -= 1
                timer.abandoned()
                self.inflight.discard(req.request_id)
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise ApiError(f"the engine failed: {item}", 503, type="server_error", code="engine_error")
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def abort_all(self) -> None:
        for rid in list(self.inflight):
            self.engine.abort(rid)


class ApiKeyCheck:
    """Pure ASGI: /v1/* over HTTP needs `Authorization: Bearer <key>` when a key is set.

    The WebSocket checks the key itself (browsers cannot set headers on a
    WebSocket, so it also takes ?api_key=).
    """

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.config.api_key
        if key and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            headers = dict(scope["headers"])
            if not key_matches(key, headers.get(b"authorization", b"").decode("latin-1")):
                err = ApiError("missing or wrong API key (send Authorization: Bearer <key>)", 401,
                               code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def key_matches(key: str, authorization: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def error_response(err: ApiError) -> Response:
    return Response(msgspec.json.encode(err.body()), err.status, headers=err.headers, media_type="application/json")


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(ApiError(str(exc.detail), exc.status_code, type=kind, headers=exc.headers))


def create_app(engine: Any, server_config: ServerConfig) -> Starlette:
    state = ServerState(engine, server_config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            state.draining = True
            state.abort_all()
            await asyncio.sleep(0)  # let the aborts reach the scheduler before the actors stop
            await engine.stop()

    async def health(request: Request) -> Response:
        if engine.dead:
            return JSONResponse({"status": "error", "error": engine.dead}, 503)
        return JSONResponse({"status": "ok", "model": state.model_name})

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(__version__))

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/metrics", state.metrics.render),
        Route("/openapi.json", openapi),
        Route("/v1/models", openai_api.models),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        WebSocketRoute("/v1/chat/ws", websocket.chat_session),
        *native_api.routes(engine),  # /generate (the frontend language), /tokenize, ...
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error})
    app.state.server = state
    endpoints = {r.path for r in routes if isinstance(r, Route)}
    app.add_middleware(ApiKeyCheck, config=server_config)
    app.add_middleware(RequestCounter, metrics=state.metrics, endpoints=endpoints)
    return app


# ---- `streamer serve` -----------------------------------------------------------


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help=f"address to bind (default {d.host}: this machine only)")
    g.add_argument("--port", type=int, default=d.port, help=f"TCP port (default {d.port})")
    g.add_argument("--api-key", default=d.api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/* (WebSocket: also ?api_key=KEY)")
    g.add_argument("--served-model-name", default=d.served_model_name,
                   help="model name reported by /v1/models and accepted in requests (default: the folder's name)")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests allowed to wait for a first token; beyond it 503 + Retry-After (default {d.max_queue})")
    g.add_argument("--session-idle-timeout", type=float, default=d.session_idle_timeout,
                   help=f"seconds before an idle WebSocket chat session is closed (default {d.session_idle_timeout:g})")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                   help="run the engine in a process of its own (--no-engine-process: in the server's process "
                        "and event loop); default: its own process on CUDA, the server's on CPU")


def wants_engine_process(config: ServerConfig) -> bool:
    """config.engine_process, or when it is None, whether the engine will run on CUDA (see
    ServerConfig.engine_process). torch.cuda.is_available() creates no CUDA context."""
    if config.engine_process is not None:
        return config.engine_process
    device = config.engine.device
    if device == "auto":
        import torch  # noqa: PLC0415 - heavy

        return torch.cuda.is_available()
    return device.startswith("cuda")


class _Server(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests before waiting for connections to drain."""

    state: ServerState

    async def shutdown(self, sockets: Any = None) -> None:
        self.state.draining = True
        self.state.abort_all()
        # let aborted turns send their final message (WebSocket "done", SSE finish chunk)
        # before uvicorn closes the connections; bounded, so a stuck client cannot hold us
        for _ in range(40):
            if not self.state.inflight:
                break
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def serve(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    d = ServerConfig()
    config = ServerConfig(
        host=getattr(args, "host", d.host), port=getattr(args, "port", d.port),
        api_key=getattr(args, "api_key", None), served_model_name=getattr(args, "served_model_name", None),
        max_queue=getattr(args, "max_queue", d.max_queue),
        session_idle_timeout=getattr(args, "session_idle_timeout", d.session_idle_timeout),
        engine_process=getattr(args, "engine_process", d.engine_process), engine=engine_config,
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine: Any
    if wants_engine_process(config):
        from streamer.engine.remote import EngineProcess  # noqa: PLC0415 - heavy (torch)

        engine = EngineProcess(engine_config)
        engine.launch()  # the model loads there; a failure raises here, before uvicorn starts
    else:
        from streamer.engine.engine import AsyncEngine  # noqa: PLC0415 - heavy (torch)

        engine = AsyncEngine(engine_config)
    app = create_app(engine, config)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                    timeout_graceful_shutdown=30, ws_ping_interval=20))
    server.state = app.state.server
    host = f"[{config.host}]" if ":" in config.host else config.host
    base = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else host}:{config.port}"
    print(f"streamer: serving {app.state.server.model_name!r}\n"
          f"  chat page:     {base}/  (open in a browser)\n"
          f"  OpenAI client: OpenAI(base_url=\"{base}/v1\", api_key=\"{'<your --api-key>' if config.api_key else 'none'}\")\n"
          f"  WebSocket:     {base.replace('http', 'ws', 1)}/v1/chat/ws", flush=True)
    server.run()
