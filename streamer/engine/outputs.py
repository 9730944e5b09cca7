"""A request's outputs as its caller sees them: increments that may be merged, or one whole.

Shared by AsyncEngine and EngineProcess (engine/remote.py), and free of the model code
(torch kernels, Triton), which the server process of `streamer serve` does not import.

  follow(request, send, opened, abort)   the one submit loop of both engines
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from streamer.engine.health import DEADLINE_GRACE_S
from streamer.messages import ENGINE_DOWN, GenerateRequest, RequestOutput


async def follow(
    request: GenerateRequest,
    send: Callable[[GenerateRequest, asyncio.Queue[RequestOutput]], Awaitable[None]],
    opened: dict[str, asyncio.Queue[RequestOutput]],
    abort: Callable[[str], None],
) -> AsyncGenerator[RequestOutput, None]:
    """An engine's submit(): send the request with a queue of its own for its outputs (send
    may raise: the engine is down), keep the queue in `opened` while the request runs (the
    engine puts a final output there for each if it dies), and yield its increments up to
    the final one. Closed early, the request is aborted; with a timeout, deadline_guard
    ends it here if the engine does not."""
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    rid = request.request_id
    await send(request, queue)
    opened[rid] = queue
    guard = deadline_guard(request, queue, abort)
    finished = False
    try:
        async for out in increments(queue):
            finished = out.finished
            yield out
    finally:
        if opened.get(rid) is queue:  # (the engine may have ended it already: EngineProcess._watch)
            del opened[rid]
        if guard is not None:
            guard.cancel()
        if not finished:
            abort(rid)


async def increments(queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue, up to the final one. A consumer that fell behind
    (a busy server) gets what has piled up as one increment: one SSE event or WebSocket
    frame instead of one per token."""
    while True:
        out = await queue.get()
        while not out.finished and not queue.empty():
            out = merge_outputs(out, queue.get_nowait())
        yield out
        if out.finished:
            return


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive increments of one request as one (b is the later)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(
        b.request_id,
        a.token_ids + b.token_ids,
        a.text + b.text,
        finished=b.finished,
        finish_reason=b.finish_reason,
        prompt_tokens=b.prompt_tokens,
        completion_tokens=b.completion_tokens,
        cached_tokens=b.cached_tokens,
        cached_host_tokens=b.cached_host_tokens,
        logprobs=logprobs,
        error=b.error or a.error,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        queue_time=a.queue_time if a.queue_time is not None else b.queue_time,
        error_code=b.error_code or a.error_code,
        prompt_token_ids=a.prompt_token_ids if a.prompt_token_ids is not None else b.prompt_token_ids,
        prompt_top_logprobs=a.prompt_top_logprobs if a.prompt_top_logprobs is not None else b.prompt_top_logprobs,
        prompt_ranks=a.prompt_ranks if a.prompt_ranks is not None else b.prompt_ranks,
        embedding=b.embedding if b.embedding is not None else a.embedding,
        stop=b.stop,
        prediction_token_ids=a.prediction_token_ids if a.prediction_token_ids is not None else b.prediction_token_ids,
    )


def engine_failed(request_id: str, reason: str, code: str = ENGINE_DOWN) -> RequestOutput:
    """The final output of a request whose engine died (or stalled: ENGINE_STALLED)."""
    what = "is down" if code == ENGINE_DOWN else "is not responding"
    return RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                         error=f"the engine {what}: {reason}", error_code=code)


def deadline_guard(request: GenerateRequest, queue: asyncio.Queue[RequestOutput],
                   abort: Callable[[str], None]) -> asyncio.TimerHandle | None:
    """For a request with a timeout: DEADLINE_GRACE_S after its deadline, end it on the
    caller's side (a final "timeout" output into its queue) and abort it, in case the engine
    did not end it itself (stopped, or not answering). Cancel the handle once it has ended."""
    timeout = request.params.timeout
    if timeout is None:
        return None
    rid = request.request_id

    def expire() -> None:
        queue.put_nowait(RequestOutput(
            rid, [], "", finished=True, finish_reason="timeout",
            error=f"the request timed out: its deadline ({timeout:g} s) passed and the engine did not end it"))
        abort(rid)

    return asyncio.get_running_loop().call_later(timeout + DEADLINE_GRACE_S, expire)


async def collect(request_id: str, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's increments as one output: all its token ids and text."""
    ids: list[int] = []
    text: list[str] = []
    logprobs: list = []
    prompt_logprobs = prompt_ids = prompt_tops = prompt_ranks = prediction = None
    queue_time = None
    last = None
    async for out in outputs:
        if out.prompt_logprobs is not None:
            prompt_logprobs, prompt_ids, prompt_tops = out.prompt_logprobs, out.prompt_token_ids, out.prompt_top_logprobs
            prompt_ranks = out.prompt_ranks
        if out.queue_time is not None:
            queue_time = out.queue_time
        if out.prediction_token_ids is not None:
            prediction = out.prediction_token_ids
        ids.extend(out.token_ids)
        text.append(out.text)
        if out.logprobs:
            logprobs.extend(out.logprobs)
        last = out
    assert last is not None
    return RequestOutput(
        request_id,
        ids,
        "".join(text),
        finished=True,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        cached_host_tokens=last.cached_host_tokens,
        logprobs=logprobs or None,
        error=last.error,
        prompt_logprobs=prompt_logprobs,
        queue_time=queue_time,
        error_code=last.error_code,
        prompt_token_ids=prompt_ids,
        prompt_top_logprobs=prompt_tops,
        prompt_ranks=prompt_ranks,
        embedding=last.embedding,
        stop=last.stop,
        prediction_token_ids=prediction,
    )
