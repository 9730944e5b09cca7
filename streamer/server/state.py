"""ServerState: the one place where HTTP and WebSocket handlers meet the engine.

Every endpoint's pipeline is: decode the body (protocol.py), check it against the limits
(limits.py), map it to engine requests (one mapping per body kind), then
ServerState.start (admission once, submit, the first output of each engine request) or,
for a WebSocket turn, admit + stream, and encode the outputs for its endpoint. The
server never tokenizes: prompts, token ids and chat messages go to the engine as they
are, and the engine's tokenizer resolves what needs the prompt's length (fill_context).

ServerState admits requests (queue limit, draining, the engine down), applies the server's
policy to their parameters (cache namespace, deadline), tracks which engine requests are in
flight (so that a shutdown can abort them all and every stream still gets its final
chunk), and feeds the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.types import Scope

from streamer.config import ServerConfig
from streamer.engine.protocol import Engine, ModelInfo
from streamer.engine.token_bytes import TokenBytes
from streamer.messages import ENGINE_DOWN, ENGINE_STALLED, GenerateRequest, RequestOutput, SamplingParams
from streamer.server.guard import KEY_ID
from streamer.server.limits import Limits
from streamer.server.metrics import Metrics, RequestTimer
from streamer.server.protocol import ApiError
from streamer.server.response_store import ResponseStore

Merged = AsyncGenerator[tuple[int, RequestOutput], None]
"""Outputs of several engine requests as they come: (the request's index, an output)."""


class OpenSession(Protocol):
    """A WebSocket session (websocket.Session), as watch_engine closes it."""

    async def engine_down(self, reason: str | None) -> None: ...


LORA = "streamer.lora"
"""Scope entry: the LoRA adapter a request's model names (ServerState.check_model), or None."""


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        # (data-parallel replicas: also each replica's engine metrics, router/data_parallel.py)
        self.metrics = Metrics(engine.stats, getattr(engine, "replica_stats", None))
        if hasattr(engine, "collector"):  # ... and the router's
            self.metrics.registry.register(engine.collector())
        self.inflight: set[str] = set()
        self.pending = 0
        """Engine requests submitted that have not produced their first output yet."""
        self.draining = False
        self.sessions: set[OpenSession] = set()
        """Open WebSocket sessions (closed when the engine dies)."""
        self.responses = ResponseStore(config.responses_store_mb << 20)
        """Stored /v1/responses turns (previous_response_id)."""
        self._limits: Limits | None = None
        self._token_bytes: TokenBytes | None = None
        self.started = int(time.time())
        """The server's start (Unix seconds): `created` of its model cards, the same in every answer."""

    @property
    def info(self) -> ModelInfo:
        """The model (an engine process knows it once launched)."""
        return self.engine.info

    @property
    def limits(self) -> Limits:
        """The request limits (built at first use: an engine process knows its context length once launched)."""
        if self._limits is None:
            self._limits = Limits(self.config, self.info.max_model_len)
        return self._limits

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.info.name

    @property
    def sampling_defaults(self) -> Mapping[str, float]:
        """What a request that omits a sampling field gets (--generation-config): the model's
        generation_config.json values (auto), or none, leaving streamer's own."""
        return self.info.generation_defaults if self.config.generation_config == "auto" else {}

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token's own bytes (logprobs' `bytes`), looked up in the vocabulary as needed."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.info.hf_tokenizer)
        return self._token_bytes

    def serves(self, name: str) -> bool:
        """The served name, or the model's own (its folder's) name, which stays an alias."""
        return name in (self.model_name, self.info.name)

    def answering(self, scope: Scope) -> str:
        """The model an answer names: the LoRA adapter the request's model named, else the served one."""
        return scope.get(LORA) or self.model_name

    def check_model(self, name: str | None, scope: Scope | None = None) -> None:
        """404 for a model this server does not serve, in OpenAI's words (an omitted model is this
        one). A LoRA adapter's name (ModelInfo.loras) is served too: the request's scope records
        it (apply_policy then runs the request with it)."""
        lora = name if name is not None and name in self.info.loras and not self.serves(name) else None
        if name is not None and lora is None and not self.serves(name):
            raise ApiError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")
        if scope is not None:
            scope[LORA] = lora

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

    def apply_policy(self, params: SamplingParams, scope: Scope) -> SamplingParams:
        """The server's part of a request's parameters: its prefix-cache namespace (with
        --cache-isolation per-key, the salt is prefixed with its API key's hash) and its
        deadline (--request-timeout is the default and the cap of the request's timeout); the
        LoRA adapter its model names (check_model)."""
        salt, timeout, cap = params.cache_salt, params.timeout, self.config.request_timeout
        if (lora := scope.get(LORA)) is not None:  # (check_model: the request's model is an adapter)
            params = msgspec.structs.replace(params, lora=lora)
        if self.config.cache_isolation == "per-key":
            key = scope.get(KEY_ID, "")
            salt = f"key:{key}" if salt is None else f"key:{key}:{salt}"  # (the hash has a fixed length)
        if cap is not None:
            timeout = cap if timeout is None else min(timeout, cap)
        if (salt, timeout) == (params.cache_salt, params.timeout):
            return params
        return msgspec.structs.replace(params, cache_salt=salt, timeout=timeout)

    async def start(self, reqs: list[GenerateRequest]) -> tuple[Merged, list[tuple[int, RequestOutput]]]:
        """Admit the engine requests of one HTTP request, submit them, and wait for every
        one's first output: a request the engine refuses (a bad parameter, a prompt too long,
        a grammar it cannot compile) arrives as a first output with finish_reason "error"
        and is raised here as its API error, while a 400 is still possible. Returns the rest
        of the outputs and the first ones."""
        self.admit(len(reqs))
        gen = self.stream(reqs)
        buffered: list[tuple[int, RequestOutput]] = []
        seen: set[int] = set()
        try:
            while len(seen) < len(reqs):
                i, out = await anext(gen)
                buffered.append((i, out))
                if i not in seen and out.finish_reason in ("error", "timeout"):
                    raise failure(out)
                seen.add(i)
        except BaseException:
            await gen.aclose()
            raise
        return gen, buffered

    async def stream(self, reqs: list[GenerateRequest]) -> Merged:
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

    async def watch_engine(self) -> None:
        """Once the engine is dead, close every WebSocket session (each with an error and a
        1011 close; a running turn ends so by itself): they cannot go on."""
        while not self.engine.dead:
            await asyncio.sleep(0.2)
        closing = [asyncio.create_task(s.engine_down(self.engine.dead)) for s in self.sessions]
        if closing:  # (together, and bounded: a client that reads nothing cannot hold the others)
            await asyncio.wait(closing, timeout=5)


def engine_down(engine: Engine) -> ApiError | None:
    """The 503 for new requests while the engine is dead or stalled (None: it serves)."""
    if engine.dead:
        return ApiError(f"the engine is down: {engine.dead}", 503, type="server_error", code=ENGINE_DOWN,
                        headers={"Retry-After": "5"})
    stalled = engine.stalled
    if stalled:
        return ApiError(f"the engine is not responding: {stalled}", 503, type="server_error",
                        code=ENGINE_STALLED, headers={"Retry-After": "5"})
    return None


class Ended(Protocol):
    """What failure() reads of an ended request: a RequestOutput, or openai_api's Choice."""

    @property
    def error(self) -> str | None: ...
    @property
    def error_code(self) -> str | None: ...
    @property
    def finish_reason(self) -> str | None: ...


def failure(out: Ended) -> ApiError:
    """A request the engine ended with an error (or at its deadline), as the API's error.

    The engine down or not responding: 503, code engine_down / engine_stalled (retry later or
    elsewhere). The request's deadline: 504, code request_timeout; a whole response is an error
    rather than partial text with a finish_reason, which a client could take for a complete
    answer (streams do send what was generated, then the finish chunk and the error). The
    engine's own failures ("internal error: ..."): 500. The rest come from the request (a
    grammar this vocabulary cannot follow, say): 400, with the engine's message, also after
    some output (and its code: context_length_exceeded)."""
    error = out.error or "generation failed"
    if out.error_code in (ENGINE_DOWN, ENGINE_STALLED):
        return ApiError(error, 503, type="server_error", code=out.error_code, headers={"Retry-After": "5"})
    if out.finish_reason == "timeout":
        return ApiError(error, 504, type="server_error", code="request_timeout")
    internal = out.error is None or out.error.startswith("internal error")
    if internal:
        return ApiError(error, 500, type="server_error")
    return ApiError(error, 400, code=out.error_code)


async def until_disconnect(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Run work; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else None


async def one_answer(gen: Merged, buffered: list[tuple[int, RequestOutput]]) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of an answer of one engine request (/v1/responses, /v1/messages): the first,
    already here (ServerState.start), then the rest, up to the final one. Closing it closes gen
    (which aborts the request if it is still running)."""
    try:
        for _, out in buffered:
            yield out
            if out.finished:
                return
        async for _, out in gen:
            yield out
            if out.finished:
                return
    finally:
        await gen.aclose()


async def feed_answer(gen: Merged, buffered: list[tuple[int, RequestOutput]],
                      feed: Callable[[RequestOutput], None]) -> bool:
    """Every output of a one-request answer to `feed`, for a whole response: an output with an
    error is raised as the response's error (failure)."""
    answer = one_answer(gen, buffered)
    try:
        async for out in answer:
            if out.error:
                raise failure(out)
            feed(out)
    finally:
        await answer.aclose()
    return True


class AnswerBuilder(Protocol):
    """A one-request answer's builder for a stream (responses_output.py, anthropic_output.py)."""

    def feed(self, out: RequestOutput) -> None: ...

    def fail(self, out: RequestOutput) -> None: ...

    def take(self) -> bytes: ...


async def answer_events(builder: AnswerBuilder, gen: Merged, buffered: list[tuple[int, RequestOutput]]
                        ) -> AsyncGenerator[bytes, None]:
    """The stream of a one-request answer: the events of each engine output in one write; an
    error after the stream began is the builder's last event (fail)."""
    answer = one_answer(gen, buffered)
    try:
        async for out in answer:
            if out.error:
                builder.fail(out)
                yield builder.take()
                return
            builder.feed(out)
            if data := builder.take():
                yield data
    finally:
        await answer.aclose()
