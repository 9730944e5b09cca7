"""The Starlette app: routes, middleware and the lifespan that starts and stops the engine.

  create_app(engine, server_config) -> Starlette   (`streamer serve` runs it: serve.py)

The routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{model}
(openai_api.py), /v1/responses (responses_api.py; stored ones: response_store_api.py), /v1/embeddings (embeddings_api.py), /v1/score and /v1/rerank (score_api.py), Anthropic's /v1/messages (anthropic_api.py), the WebSocket chat /v1/chat/ws (websocket.py), the native API /generate,
/tokenize, /detokenize, /apply_chat_template, /version (native_api.py), /health (also as
/ping), vLLM's /invocations (a chat, completion or embeddings body, by its fields), /metrics,
/openapi.json (openapi.py) and the chat page. Their handlers meet the
engine through one ServerState (state.py), at app.state.server. Every request passes
guard.py's middleware first (Host and Origin, the API key, the JSON body's size and time).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from streamer import __version__
from streamer.config import ServerConfig
from streamer.engine.protocol import Engine
from streamer.server import (
    anthropic_api,
    embeddings_api,
    lora_api,
    native_api,
    openai_api,
    response_store_api,
    responses_api,
    score_api,
    websocket,
)
from streamer.server.guard import ApiKeyCheck, HostCheck, JsonBody, error_response
from streamer.server.metrics import RequestCounter
from streamer.server.openapi import openapi_document
from streamer.server.protocol import ApiError
from streamer.server.state import ServerState

STATIC = Path(__file__).parent / "static"


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(ApiError(str(exc.detail), exc.status_code, type=kind, headers=exc.headers))


def create_app(engine: Engine, server_config: ServerConfig) -> Starlette:
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
            await state.responses.cancel_all()  # (background responses: stored as cancelled)
            state.abort_all()
            await asyncio.sleep(0)  # let the aborts reach the scheduler before the actors stop
            await engine.stop()

    async def health(request: Request) -> Response:
        """200 while the engine serves; 503 once it is dead, and while it is stalled: its
        process silent for health.HEARTBEAT_S, or a step running for STEP_STALL_S. With
        data-parallel replicas, each one's status too; "degraded" (200) while some are down."""
        replicas = getattr(engine, "replica_status", None)  # data-parallel replicas, each ok or not
        extra = {"replicas": replicas()} if replicas is not None else {}
        if engine.dead:
            return JSONResponse({"status": "error", "error": engine.dead, **extra}, 503)
        stalled = engine.stalled
        if stalled:
            return JSONResponse({"status": "stalled", "error": stalled, **extra}, 503)
        degraded = any(r["status"] != "ok" for r in extra.get("replicas", ()))  # (the others serve on)
        return JSONResponse({"status": "degraded" if degraded else "ok", "model": state.model_name, **extra})

    async def invocations(request: Request) -> Response:
        """vLLM's (and SageMaker's) POST /invocations: a chat completion, completion or embeddings
        body, told apart by its messages, prompt or input, answered by that route."""
        try:  # (the top level only: the route decodes the rest, and answers JSON too deep or malformed)
            fields = msgspec.json.decode(await request.body(), type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, RecursionError):
            fields = {}
        for field, route in (("messages", openai_api.chat_completions), ("prompt", openai_api.completions),
                             ("input", embeddings_api.embeddings)):
            if field in fields:
                return await route(request)
        raise ApiError("an /invocations body is a chat completion (messages), a completion (prompt) or an "
                       "embeddings request (input)")

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(__version__))

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/ping", health, methods=["GET", "POST"]),  # (SageMaker's health check, as vLLM serves it)
        Route("/invocations", invocations, methods=["POST"]),
        Route("/metrics", state.metrics.render),
        Route("/openapi.json", openapi),
        Route("/v1/models", openai_api.models),
        Route("/v1/models/{model:path}", openai_api.model),  # (:path: a name may hold "/", org/model)
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/responses", responses_api.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", response_store_api.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", response_store_api.input_items),
        Route("/v1/responses/{response_id}/cancel", response_store_api.cancel, methods=["POST"]),
        Route("/v1/embeddings", embeddings_api.embeddings, methods=["POST"]),
        Route("/v1/load_lora_adapter", lora_api.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", lora_api.unload_lora_adapter, methods=["POST"]),
        Route("/v1/score", score_api.score, methods=["POST"]),
        *[Route(path, score_api.rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")],
        Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
        WebSocketRoute("/v1/chat/ws", websocket.chat_session),
        *native_api.routes(),  # /generate (the frontend language), /tokenize, ...
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error})
    app.state.server = state
    endpoints = {r.path for r in routes if isinstance(r, Route)}
    posts = {r.path for r in routes if isinstance(r, Route) and "POST" in (r.methods or ())} - {"/ping"}
    # outermost last: count, check the Host / Origin, then the key, then read the body
    app.add_middleware(JsonBody, config=server_config, paths=posts)
    app.add_middleware(ApiKeyCheck, config=server_config)
    app.add_middleware(HostCheck, config=server_config)
    app.add_middleware(RequestCounter, metrics=state.metrics, endpoints=endpoints)
    return app
