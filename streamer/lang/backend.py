"""Backends: where a program's requests go.

  Backend             the interface: an event loop (in its own thread) and four coroutines
    .loop             the loop every expression of a program runs on
    .tokenize(texts)  -> token ids per text, as the engine tokenizes a text prompt
    .render_chat(conversations) -> the chat template applied to each (no generation prompt)
    .generate(prompt, params)   -> async iterator of RequestOutput deltas; RequestError on failure
    .complete(prompt, params)   -> the final RequestOutput, everything merged
  EngineBackend(llm_or_engine)   an engine of this process (engine/protocol.py's Engine), or an LLM's
  RuntimeEndpoint(base_url)      a running server's native /generate (runtime_endpoint.py)

Programs run in worker threads and hand each expression to the backend's loop,
so many programs and branches have requests in flight at once and the
scheduler batches them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any

from streamer.engine.protocol import Engine
from streamer.errors import RequestError
from streamer.messages import GenerateRequest, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from streamer.engine.llm import LLM


class LoopThread:
    """An asyncio loop running forever in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class Backend:
    loop: asyncio.AbstractEventLoop

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    async def render_chat(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        raise NotImplementedError

    def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError

    async def complete(self, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
        ids: list[int] = []
        text: list[str] = []
        last, prompt_logprobs = None, None
        async for out in self.generate(prompt, params):
            ids.extend(out.token_ids)
            text.append(out.text)
            prompt_logprobs = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_logprobs
            last = out
        assert last is not None
        return RequestOutput(last.request_id, ids, "".join(text), finished=True, finish_reason=last.finish_reason,
                             prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                             cached_tokens=last.cached_tokens, prompt_logprobs=prompt_logprobs)

    def close(self) -> None:
        """Release what the backend owns (never an engine or LLM it was given)."""


class EngineBackend(Backend):
    """An engine of this process: an LLM's (its loop is reused), or an Engine (an AsyncEngine,
    an EngineProcess) not started elsewhere.

    An Engine is started on a loop thread of this backend; hand over one that is not
    already running on another loop (its queues belong to one loop).
    """

    def __init__(self, llm_or_engine: LLM | Engine) -> None:
        self._own: LoopThread | None = None
        self.engine: Engine
        if hasattr(llm_or_engine, "engine") and hasattr(llm_or_engine, "loop"):  # streamer.LLM
            self.engine, self.loop = llm_or_engine.engine, llm_or_engine.loop
        else:
            self.engine = llm_or_engine  # type: ignore[assignment]
            self._own = LoopThread("streamer-lang")
            self.loop = self._own.loop
            self._own.call(self.engine.start())
        self.hf = self.engine.info.hf_tokenizer
        if self.hf is None:
            raise RequestError("the frontend language needs a model with a tokenizer")

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        # the same call the engine's tokenizer makes for a text prompt
        return [list(x) for x in self.hf(texts, add_special_tokens=True)["input_ids"]]

    async def render_chat(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        return [self.hf.apply_chat_template(c, tokenize=False) if c else "" for c in conversations]

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        rid = self.engine.new_request_id()
        if isinstance(prompt, str):
            req = GenerateRequest(request_id=rid, prompt=prompt, params=params)
        else:
            req = GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), params=params)
        async for out in self.engine.submit(req):
            if out.error is not None:
                raise RequestError(out.error)
            yield out

    def close(self) -> None:
        if self._own is not None:
            self._own.call(self.engine.stop())
            self._own.stop()
            self._own = None
