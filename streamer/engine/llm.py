"""LLM: the synchronous offline API over AsyncEngine (scripts, tests, benchmarks).

The engine's event loop runs in a background thread; generate() submits every
prompt at once and waits, so the scheduler batches them continuously. An LLM still open
when the interpreter exits is closed then (_close_all), so that its engine stops in order.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from streamer.config import EngineConfig
from streamer.engine.engine import AsyncEngine
from streamer.engine.pooling import unit
from streamer.errors import ConfigError, RequestError
from streamer.messages import GenerateRequest, RequestOutput, SamplingParams

_open: weakref.WeakSet[LLM] = weakref.WeakSet()
EXIT_STOP_S = 10.0


@atexit.register
def _close_all() -> None:
    # A script that never closes its LLM exits with the engine's actors pending on a loop
    # whose thread dies with the interpreter, and with what engine start froze out of the
    # cyclic GC's reach (engine._Collector): the last collections then either destroy the
    # pending tasks ("Task was destroyed but it is pending!") or skip the frozen cycles, and
    # nanobind reports Triton's objects among them as leaked ("nanobind: leaked N
    # instances"). Stopping the engine first ends the tasks and unfreezes the objects.
    for llm in list(_open):
        try:
            llm.close(stop_timeout=EXIT_STOP_S)
        except TimeoutError:  # (a step that never ends must not hold the exit)
            pass


class LLM:
    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        # offline, every request is known up front: none arrives to join a held step
        kwargs.setdefault("hold_ahead_ms", 0.0)
        if "data_parallel_size" in kwargs:
            raise ConfigError("LLM runs one engine in this process: data_parallel_size is not an option of it "
                              "(replicas behind a router: `streamer serve --data-parallel-size N`)")
        self.engine = AsyncEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="streamer-llm", daemon=True)
        self._thread.start()
        self.call(self.engine.start())
        _open.add(self)

    def call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def tokenizer(self):
        return self.engine.hf_tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. Prompts are strings or lists of token ids."""
        batch: list[Any] = (
            [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        )
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        reqs = []
        for p, sp in zip(batch, plist):
            rid = self.engine.new_request_id()
            if isinstance(p, str):
                reqs.append(GenerateRequest(request_id=rid, prompt=p, params=sp))
            else:
                reqs.append(GenerateRequest(request_id=rid, prompt_token_ids=list(p), params=sp))
        return self.call(self._run(reqs))

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> RequestOutput:
        """One chat completion; tools and chat_template_kwargs go to the chat template (the
        text comes back as written: the server's parsers make tool calls of it)."""
        rid = self.engine.new_request_id()
        req = GenerateRequest(request_id=rid, messages=messages, params=params or SamplingParams(), tools=tools,
                              chat_template_kwargs=chat_template_kwargs)
        return self.call(self._run([req]))[0]

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]], normalize: bool | None = None
              ) -> list[list[float]]:
        """One embedding per prompt (text or token ids), in order: the final hidden state at
        the prompt's last token (engine/pooling.py), L2-normalized as the model's folder says
        (normalize: override it). Raises RequestError for a prompt the engine refuses."""
        pooling = self.engine.info.pooling
        if pooling.unsupported is not None:
            raise RequestError(pooling.unsupported)
        params = SamplingParams(max_tokens=1, temperature=0, embed=True)
        outs = self.generate(prompts, params)
        failed = next((o for o in outs if o.embedding is None), None)
        if failed is not None:
            raise RequestError(failed.error or "no embedding")
        norm = pooling.normalize if normalize is None else normalize
        return [unit(o.embedding) if norm else list(o.embedding) for o in outs]  # type: ignore[arg-type]

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the PEFT adapter folder at `path` as `name` (SamplingParams.lora) from now on; needs
        allow_runtime_lora_updating (AsyncEngine.load_lora)."""
        self.call(self.engine.load_lora(name, path, replace))

    def unload_lora(self, name: str) -> None:
        """Stop serving the adapter `name` (AsyncEngine.unload_lora)."""
        self.call(self.engine.unload_lora(name))

    async def _run(self, reqs: list[GenerateRequest]) -> list[RequestOutput]:
        return list(await asyncio.gather(*(self.engine.generate(r) for r in reqs)))

    def stats(self):
        return self.engine.stats()

    def wait_idle(self, timeout: float = 2.0):
        """Stats once nothing runs and every page is free or cached, or after timeout.

        A request's caller may see its last output a moment before its pages come back
        (a stop string's Finish is still on its way, or a batch in flight holds them)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s.running == 0 and s.pages_used == s.pages_cached) or time.monotonic() > deadline:
                return s
            time.sleep(0.02)

    def check(self) -> None:
        """Assert the page invariants (tests): call when no request is running."""

        async def _check():
            self.engine.scheduler.check()

        self.call(_check())

    def close(self, stop_timeout: float | None = None) -> None:
        _open.discard(self)
        if self.loop.is_running():
            self.call(self.engine.stop(), stop_timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.engine.runner.release()  # the model and the KV pool go now, not at garbage collection
        self.engine.step_thread.close()  # (and its OpenMP team: engine/step_thread.py)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
