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
import hashlib
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
from streamer.config import CACHE_ISOLATIONS, EngineConfig, ServerConfig
from streamer.errors import RequestError
from streamer.messages import ENGINE_DOWN, ENGINE_STALLED, GenerateRequest, RequestOutput, SamplingParams
from streamer.server import native_api, openai_api, transport, websocket
from streamer.server.guard import HostCheck, JsonBody
from streamer.server.limits import Limits
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
        self.sessions: set[websocket.Session] = set()
        """Open WebSocket sessions (closed when the engine dies)."""
        self._limits: Limits | None = None

    @property
    def limits(self) -> Limits:
        """The request limits (built at first use: an engine process knows its context length once launched)."""
        if self._limits is None:
            self._limits = Limits(self.config, self.engine.max_model_len)
        return self._limits

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
        something already waits and taking it would exceed max_queue; one of more
        engine requests than max_queue could never be taken, and is a 400.
        """
        if n > self.config.max_queue:
            raise ApiError(f"the request: {n:,} engine requests (prompts x n), more than the limit of "
                           f"{self.config.max_queue:,} (streamer serve --max-queue)", code="limit_exceeded")
        if self.draining:
            raise ApiError("the server is shutting down", 503, type="server_error", code="unavailable",
                           headers={"Retry-After": "5"})
        down = engine_down(self.engine)
        if down is not None:
            raise down
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

    def apply_policy(self, params: SamplingParams, scope: Scope) -> SamplingParams:
        """The server's part of a request's parameters: its prefix-cache namespace (with
        --cache-isolation per-key, the salt is prefixed with its API key's hash) and its
        deadline (--request-timeout is the default and the cap of the request's timeout)."""
        salt, timeout, cap = params.cache_salt, params.timeout, self.config.request_timeout
        if self.config.cache_isolation == "per-key":
            key = scope.get(KEY_ID, "")
            salt = f"key:{key}" if salt is None else f"key:{key}:{salt}"  # (the hash has a fixed length)
        if cap is not None:
            timeout = cap if timeout is None else min(timeout, cap)
        if (salt, timeout) == (params.cache_salt, params.timeout):
            return params
        return msgspec.structs.replace(params, cache_salt=salt, timeout=timeout)

    async def watch_engine(self) -> None:
        """Once the engine is dead, close every WebSocket session (each with an error and a
        1011 close; a running turn ends so by itself): they cannot go on."""
        while not self.engine.dead:
            await asyncio.sleep(0.2)
        closing = [asyncio.create_task(s.engine_down(self.engine.dead)) for s in self.sessions]
        if closing:  # (together, and bounded: a client that reads nothing cannot hold the others)
            await asyncio.wait(closing, timeout=5)


def engine_down(engine: Any) -> ApiError | None:
    """The 503 for new requests while the engine is dead or stalled (None: it serves)."""
    if engine.dead:
        return ApiError(f"the engine is down: {engine.dead}", 503, type="server_error", code=ENGINE_DOWN,
                        headers={"Retry-After": "5"})
    stalled = engine.stalled
    if stalled:
        return ApiError(f"the engine is not responding: {stalled}", 503, type="server_error",
                        code=ENGINE_STALLED, headers={"Retry-After": "5"})
    return None


class ApiKeyCheck:
    """Pure ASGI: the PROTECTED paths over HTTP need `Authorization: Bearer <key>`, one of the
    keys, when keys are set; the hash of the key goes to scope[KEY_ID] (per-key cache isolation).

    The WebSocket checks the key itself (browsers cannot set headers on a
    WebSocket, so it also takes ?api_key=).
    """

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.config.api_keys
        if keys and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            headers = dict(scope["headers"])
            key = matching_key(keys, bearer(headers.get(b"authorization", b"").decode("latin-1")))
            if key is None:
                err = ApiError("missing or wrong API key (send Authorization: Bearer <key>)", 401,
                               code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
            scope[KEY_ID] = key_id(key)
        await self.app(scope, receive, send)


KEY_ID = "streamer.key_id"
"""Scope entry: the hash of the API key a request authenticated with (ServerState.apply_policy)."""


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
        watch = asyncio.create_task(state.watch_engine(), name="streamer-watch-engine")
        try:
            yield
        finally:
            watch.cancel()
            state.draining = True
            state.abort_all()
            await asyncio.sleep(0)  # let the aborts reach the scheduler before the actors stop
            await engine.stop()

    async def health(request: Request) -> Response:
        """200 while the engine serves; 503 once it is dead, and while it is stalled: its
        process silent for health.HEARTBEAT_S, or a step running for STEP_STALL_S."""
        if engine.dead:
            return JSONResponse({"status": "error", "error": engine.dead}, 503)
        stalled = engine.stalled
        if stalled:
            return JSONResponse({"status": "stalled", "error": stalled}, 503)
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
    posts = {r.path for r in routes if isinstance(r, Route) and "POST" in (r.methods or ())}
    # outermost last: count, check the Host / Origin, then the key, then read the body
    app.add_middleware(JsonBody, config=server_config, paths=posts)
    app.add_middleware(ApiKeyCheck, config=server_config)
    app.add_middleware(HostCheck, config=server_config)
    app.add_middleware(RequestCounter, metrics=state.metrics, endpoints=endpoints)
    return app


# ---- `streamer serve` -----------------------------------------------------------


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help=f"address to bind (default {d.host}: this machine only)")
    g.add_argument("--port", type=int, default=d.port, help=f"TCP port (default {d.port})")
    g.add_argument("--api-key", dest="api_keys", action="append", type=_names, default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and the native API (WebSocket: also "
                        "?api_key=KEY); several keys: repeat the flag or separate them with commas")
    g.add_argument("--cache-isolation", choices=CACHE_ISOLATIONS, default=d.cache_isolation,
                   help="per-key: requests of different API keys never share prefix-cache pages (nor learn "
                        "from cached_tokens or timing what the other keys' prompts were; needs --api-key); "
                        "none: shared, unless a request gives a cache_salt (default none)")
    g.add_argument("--request-timeout", type=_positive(float), default=d.request_timeout, metavar="SECONDS",
                   help="seconds a request may run, from its arrival to its end (queued, running): then it "
                        "ends with a timeout error; also caps a request's own 'timeout' (default: no limit)")
    g.add_argument("--served-model-name", default=d.served_model_name,
                   help="model name reported by /v1/models and accepted in requests (default: the folder's name)")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests allowed to wait for a first token; beyond it 503 + Retry-After (default {d.max_queue})")
    g.add_argument("--session-idle-timeout", type=float, default=d.session_idle_timeout,
                   help=f"seconds before an idle WebSocket chat session is closed (default {d.session_idle_timeout:g})")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                   help="run the engine in a process of its own (--no-engine-process: in the server's process "
                        "and event loop); default: its own process on CUDA, the server's on CPU")
    add_limit_args(p, d)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def add_limit_args(p: argparse.ArgumentParser, d: ServerConfig) -> None:
    """The limits on hostile input (README "Reliability limits"); each refusal names its flag."""
    g = p.add_argument_group("request limits (a request over one is refused with 400, the body with 413)")
    pi, pf = _positive(int), _positive(float)
    for flag, what in [
        ("--max-request-bytes", "bytes of an HTTP body (413 beyond it) or a WebSocket message"),
        ("--max-stop", "stop strings, and stop token ids, per request"),
        ("--max-stop-chars", "characters of one stop string"),
        ("--max-logit-bias", "logit_bias entries per request"),
        ("--max-choices", "guided_choice / choices entries per request"),
        ("--max-messages", "messages of a chat request, a WebSocket session or a conversation"),
        ("--max-conversations", "conversations per /apply_chat_template"),
        ("--max-batch", "engine requests one HTTP request may start: prompts x n, /generate and /tokenize lists"),
        ("--max-n", "choices (n) per request"),
    ]:
        default = getattr(d, flag[2:].replace("-", "_"))
        g.add_argument(flag, type=pi, default=default, help=f"{what} (default {default:,})")
    g.add_argument("--max-prompt-chars", type=pi, default=d.max_prompt_chars,
                   help="characters of text prompt per request (prompts, message contents, texts summed), "
                        "checked before tokenizing (default: 32 per token of the model's context)")
    g = p.add_argument_group("connections")
    g.add_argument("--max-connections", type=pi, default=d.max_connections,
                   help="open connections, HTTP and WebSocket; beyond it a new one gets 503 and is closed "
                        "(default 2048, fewer if the open-files limit is lower)")
    g.add_argument("--timeout-idle-connection", type=pf, default=d.timeout_idle_connection,
                   help="seconds a connection may take to send a complete request head, from its opening or "
                        f"from the previous response; then it is closed (default {d.timeout_idle_connection:g})")
    g.add_argument("--timeout-request-body", type=pf, default=d.timeout_request_body,
                   help=f"seconds a request body may take to arrive (408 beyond; default {d.timeout_request_body:g})")
    g.add_argument("--allowed-hosts", type=_names, default=d.allowed_hosts,
                   help="comma-separated Host names served ('*': any, '*.example.com': its subdomains); "
                        "default: localhost, 127.0.0.1, [::1] when bound to a loopback address, any otherwise")
    g.add_argument("--allowed-origins", type=_names, default=d.allowed_origins,
                   help="comma-separated Origins that may open the WebSocket ('*': any; e.g. "
                        "https://app.example.com); always allowed: the server's own origin, and pages on "
                        "loopback names when bound to a loopback address (unless this flag is given)")


LIMIT_FIELDS = ("max_request_bytes", "max_prompt_chars", "max_stop", "max_stop_chars", "max_logit_bias",
                "max_choices", "max_messages", "max_conversations", "max_batch", "max_n", "max_connections",
                "timeout_idle_connection", "timeout_request_body", "allowed_hosts", "allowed_origins")
"""ServerConfig fields that add_limit_args makes flags of, under the same names."""


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
        api_keys=tuple(k for ks in getattr(args, "api_keys", None) or [] for k in ks),
        served_model_name=getattr(args, "served_model_name", None),
        cache_isolation=getattr(args, "cache_isolation", d.cache_isolation),
        request_timeout=getattr(args, "request_timeout", d.request_timeout),
        max_queue=getattr(args, "max_queue", d.max_queue),
        session_idle_timeout=getattr(args, "session_idle_timeout", d.session_idle_timeout),
        engine_process=getattr(args, "engine_process", d.engine_process), engine=engine_config,
        **{f: getattr(args, f, getattr(d, f)) for f in LIMIT_FIELDS},
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
    max_connections = config.max_connections or transport.default_max_connections()
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=30,
        ws_ping_interval=20, ws_max_size=config.max_request_bytes,
        http=transport.guarded_http(config.timeout_idle_connection, max_connections),
        timeout_keep_alive=config.timeout_idle_connection))
    transport.redact_logs()  # after uvicorn.Config, which configures its loggers
    server.state = app.state.server
    host = f"[{config.host}]" if ":" in config.host else config.host
    base = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else host}:{config.port}"
    print(f"streamer: serving {app.state.server.model_name!r}\n"
          f"  chat page:     {base}/  (open in a browser)\n"
          f"  OpenAI client: OpenAI(base_url=\"{base}/v1\", api_key=\"{'<your --api-key>' if config.api_keys else 'none'}\")\n"
          f"  WebSocket:     {base.replace('http', 'ws', 1)}/v1/chat/ws", flush=True)
    server.run()
