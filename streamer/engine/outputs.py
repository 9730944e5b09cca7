"""A request's outputs as its caller sees them: increments that may be merged, or one whole.

Shared by AsyncEngine and EngineProcess (engine/remote.py), and free of the model code
(torch kernels, Triton), which the server process of `streamer serve` does not import.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from streamer.messages import RequestOutput


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
        logprobs=logprobs,
        error=b.error or a.error,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        queue_time=a.queue_time if a.queue_time is not None else b.queue_time,
    )


async def collect(request_id: str, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's increments as one output: all its token ids and text."""
    ids: list[int] = []
    text: list[str] = []
    logprobs: list = []
    prompt_logprobs = None
    queue_time = None
    last = None
    async for out in outputs:
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
        if out.queue_time is not None:
            queue_time = out.queue_time
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
        logprobs=logprobs or None,
        error=last.error,
        prompt_logprobs=prompt_logprobs,
        queue_time=queue_time,
    )
