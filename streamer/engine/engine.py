"""AsyncEngine: builds the actors and the queues between them (engine/protocol.py's Engine).

  submit(GenerateRequest) -> async iterator of RequestOutput (ends with finished=True)
  enqueue(GenerateRequest, sink) -> the request's outputs go to sink.put_nowait instead
  abort(request_id)        -> the request stops wherever it is; its pages are freed
  stats()                  -> EngineStats
  dead, stalled            -> why it cannot serve (crashed; a step that does not end), or None
  info                     -> the model's name, context, vocabulary, EOS ids and tokenizer

Closing the iterator early (a client went away) aborts the request. If an actor crashes,
every request still open through submit() ends with an ENGINE_DOWN error output.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import itertools
import logging
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from streamer.config import EngineConfig
from streamer.diagnostics import Diagnostics
from streamer.engine import detokenizer, executor, scheduler, tokenizer
from streamer.engine.adapters import LoraRegistry
from streamer.engine.generation_config import generation_defaults
from streamer.engine.health import step_stalled
from streamer.engine.outputs import collect, engine_failed, follow
from streamer.engine.pooling import pooling_config
from streamer.engine.protocol import ModelInfo
from streamer.engine.scheduler import Scheduler
from streamer.engine.step_thread import StepThread
from streamer.engine.tokenizer import load_tokenizer
from streamer.engine_stats import EngineStats
from streamer.messages import (
    Abort,
    GenerateRequest,
    Register,
    RequestOutput,
    SamplingParams,
    Shutdown,
    ToDetokenizer,
    Tokenize,
    ToScheduler,
)
from streamer.model.runner import ModelRunner, pick_device
from streamer.model.source import model_name, resolve_model
from streamer.model.windows import kv_window

log = logging.getLogger("streamer.engine")

# The launch thread runs a step's Python (kernel launches) while the event loop and the
# token-waiting thread hand messages on; at the default 5 ms GIL switch interval each
# hand-over can wait for the launcher's slice to end. Measured on the H200 (8B shape, a
# lone 512-token prompt): 23 ms to the first token at 5 ms, 16 ms at 0.1 ms.
GIL_SWITCH_INTERVAL_S = 1e-4

# Allocations between young collections of the cyclic GC while the engine runs (Python's
# default: 700). A decode step at batch 512 makes ~3,000 containers (messages, token lists),
# so at the default a full collection came every ~22 steps, and it walks every live
# request's token lists: ~25 ms with the event loop and the launch thread stopped, long
# enough for the GPU to run dry (W3 on the H200: 95 such stalls, 3 s of a 86 s run).
GC_GEN0_THRESHOLD = 50_000


class _Collector:
    """The cyclic GC's settings while engines run in this process (one instance)."""

    def __init__(self) -> None:
        self.running = 0
        self.saved = gc.get_threshold()

    def engine_started(self) -> None:
        # What exists now (modules, the model, tokenizers: ~340k objects) lives as long as
        # the engine: out of the collector's reach, a full collection takes ~15 ms instead of
        # ~180 ms, a pause of the event loop, and so of the GPU, every few thousand tokens
        # (measured on the server at saturation, CPU machine)
        gc.collect()
        gc.freeze()
        if self.running == 0:
            self.saved = gc.get_threshold()
            gc.set_threshold(max(GC_GEN0_THRESHOLD, self.saved[0]), *self.saved[1:])
        self.running += 1

    def engine_stopped(self) -> None:
        gc.unfreeze()  # (what start froze can be collected again once unreachable)
        self.running -= 1
        if self.running == 0:
            gc.set_threshold(*self.saved)

    def at_exit(self) -> None:
        # An engine never stopped (an LLM never closed) leaves its objects frozen, and the
        # interpreter's last collections skip frozen objects: cycles through Triton's module
        # state then outlive finalization, and nanobind (libtriton's bindings) prints
        # "nanobind: leaked N instances / types / functions" at every such program's exit.
        if self.running:
            gc.unfreeze()


_collector = _Collector()
atexit.register(_collector.at_exit)


def resolve_model_path(config: EngineConfig) -> Path:
    return resolve_model(config.model, config.cache_dir)


def eos_ids(hf_config: Any, hf_tokenizer: Any, path: Path) -> list[int]:
    ids: set[int] = set()
    for src in (hf_config,):
        e = getattr(src, "eos_token_id", None)
        ids |= set(e if isinstance(e, list) else [e] if e is not None else [])
    gen = path / "generation_config.json"
    if gen.is_file():
        import json

        e = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(e if isinstance(e, list) else [e] if e is not None else [])
    if hf_tokenizer is not None and hf_tokenizer.eos_token_id is not None:
        ids.add(hf_tokenizer.eos_token_id)
    return sorted(ids)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        self.model_path = resolve_model_path(self.config)
        self.diagnostics = Diagnostics.from_env()
        self.step_thread = StepThread()
        """Runs every step; on the CPU the runner is built there too (engine/step_thread.py says why)."""
        if self.config.tensor_parallel_size > 1:  # rank 0 of a group (streamer/distributed/)
            from streamer.distributed.launch import start_ranks

            self.runner = start_ranks(self.config, self.model_path, self.diagnostics)
        elif pick_device(self.config.device).type == "cpu":
            self.runner = self.step_thread.call(ModelRunner, self.config, str(self.model_path), self.diagnostics)
        else:
            self.runner = ModelRunner(self.config, str(self.model_path), self.diagnostics)
        self._collector_started = False
        """start() told _collector (stop() undoes it)."""
        self.hf_tokenizer = load_tokenizer(self.model_path, self.config.chat_template)
        hf = self.runner.hf_config
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_ids(hf, self.hf_tokenizer, self.model_path)
        pool = self.runner.pool
        self.tokenizer = tokenizer.Tokenizer(self.hf_tokenizer, self.eos_token_ids, self.max_model_len, hf.vocab_size,
                                             pool_tokens=pool.capacity * pool.page_size)
        self.tokenizer.chat_template_kwargs = dict(self.config.default_chat_template_kwargs or {})
        self.adapters = LoraRegistry(self.config, self.model_name)
        """LoRA adapters by name (engine/adapters.py): those of lora_modules, and any loaded while serving."""
        self.info = ModelInfo(self.model_name, self.max_model_len, hf.vocab_size, self.eos_token_ids,
                              self.hf_tokenizer, generation_defaults=generation_defaults(self.model_path),
                              chat_template_kwargs=dict(self.config.default_chat_template_kwargs or {}),
                              pooling=pooling_config(self.model_path),
                              loras=self.adapters.names)
        self.tokenizer.loras = self.adapters.keys
        self.tokenizer.priorities = self.config.scheduling_policy == "priority"
        self.scheduler = Scheduler(self.config, self.runner.pool, self.max_model_len, hf.vocab_size,
                                   self.diagnostics, kv_window=kv_window(hf))
        self._attach_grammar()
        overlap = self.config.overlap_schedule
        self.overlap: bool = self.runner.device.type == "cuda" if overlap is None else overlap
        self._tasks: list[asyncio.Task] = []
        self._counter = 0
        self.dead: str | None = None
        self._open: dict[str, asyncio.Queue[RequestOutput]] = {}
        """Queues of the requests open through submit(): each gets a final output if an actor dies."""

    def _attach_grammar(self) -> None:
        if self.hf_tokenizer is None:
            return
        try:
            from streamer.sampling.grammar_compiler import GrammarCompiler
        except ImportError:
            return
        c = self.config
        self.tokenizer.grammars = GrammarCompiler(
            self.hf_tokenizer, self.runner.hf_config.vocab_size, stop_token_ids=self.eos_token_ids,
            timeout_s=c.grammar_compile_timeout, memory_bytes=c.grammar_compile_memory_mb << 20,
            workers=c.grammar_compile_workers,
        )
        # A jumped chunk makes a multi-token step, and a batch with jump-forward cannot be
        # scheduled ahead (its rows change length): with CUDA graphs the H200 measured the
        # 8B shape 0.121 ms/token with it against 0.106 without (grammar_bench, batch 64;
        # host-bound SmolLM2 gained, 0.058 against 0.086). Off wherever graphs are on.
        if self.runner.graphs is not None:
            self.scheduler.jump_forward = False

    @property
    def model_name(self) -> str:
        return model_name(self.config.model)
    async def start(self) -> None:
        if self._tasks:
            return
        self.q_tok: asyncio.Queue[Tokenize | Shutdown] = asyncio.Queue()
        self.q_sched: asyncio.Queue[ToScheduler] = asyncio.Queue()
        self.q_exec = executor.Inbox()
        self.q_detok: asyncio.Queue[ToDetokenizer] = asyncio.Queue()
        actors = {
            "tokenizer": tokenizer.run(self.tokenizer, self.q_tok, self.q_sched, self.q_detok),
            "scheduler": scheduler.run(self.scheduler, self.q_sched, self.q_exec, self.q_detok, self.overlap),
            "executor": executor.run(self.runner, self.q_exec, self.q_sched, self.step_thread),
            "detokenizer": detokenizer.run(self.hf_tokenizer, self.q_detok, self.q_sched),
        }
        if self.runner.device.type == "cuda":
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if self.config.grammar_prestart and self.tokenizer.grammars is not None:
            self.tokenizer.grammars.start()
        watch = getattr(self.runner, "watch", None)  # (tensor parallelism: a rank that dies)
        if watch is not None:
            loop = asyncio.get_running_loop()
            watch(lambda why: loop.call_soon_threadsafe(self._down, why))
        for name, coro in actors.items():
            task = asyncio.create_task(coro, name=f"streamer-{name}")
            task.add_done_callback(self._actor_done)
            self._tasks.append(task)
        self.diagnostics.on_start(self.runner.device.type == "cuda", log)
        if self.config.warmup and self.runner.device.type == "cuda":
            await self._warm_up()
        _collector.engine_started()
        self._collector_started = True

    async def _warm_up(self) -> None:
        """Short requests that make Triton build the kernel variants of every kind of step
        now rather than in the middle of serving (a variant first needed by a user's step
        stalled it for 1-2 s on the H200): prompts of different lengths together (a step
        replayed from a CUDA graph); steps of more tokens than the graphs take (eager), in
        prompts short enough for the context; and a mixed step through the split path (its
        decodes through the decode kernel), which serving takes only once decodes hold
        `split_decode_tokens` of context."""
        vocab = self.runner.hf_config.vocab_size
        c = self.config
        room = self.max_model_len - 8  # the longest prompt with room for its new tokens
        numbers = itertools.count()

        def request(n: int, max_tokens: int = 4) -> GenerateRequest:
            k = next(numbers)  # (distinct prompts: a cached prefix would skip the work)
            ids = [(i * 7919 + 104729 * k + n) % vocab for i in range(n)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            return GenerateRequest(request_id=f"warmup-{k}", prompt_token_ids=ids, params=params)

        t0 = time.monotonic()
        lengths = sorted({min(n, room) for n in (7, 100, 700)})
        await asyncio.gather(*(self.generate(request(n)) for n in lengths if n > 0))
        if c.cuda_graphs and room > 0:
            for total in (c.cuda_graph_max_tokens + 64, c.cuda_graph_max_tokens + 65):
                # (two totals: Triton specializes integers on divisibility by 16)
                parts = -(-total // room)
                if total > c.max_num_batched_tokens or parts > c.max_num_seqs:
                    continue
                sizes = [total // parts + (i < total % parts) for i in range(parts)]
                await asyncio.gather(*(self.generate(request(n)) for n in sizes))
        if room >= 64 and c.max_num_seqs > 1:
            runner = self.runner
            saved, runner.split_decode_tokens = runner.split_decode_tokens, 0
            try:
                joining: asyncio.Task | None = None
                async for _ in self.submit(request(16, max_tokens=16)):
                    if joining is None:  # decoding now: a prompt joins its steps
                        joining = asyncio.create_task(self.generate(request(min(room, 300))))
                if joining is not None:
                    await joining
            finally:
                runner.split_decode_tokens = saved
        log.info("warm-up done in %.1f s", time.monotonic() - t0)

    def _actor_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine actor %s crashed", task.get_name(), exc_info=task.exception())
        self._down(f"{task.get_name()} crashed: {task.exception()!r}")

    def _down(self, why: str) -> None:
        if self.dead:
            return
        self.dead = why
        for rid, queue in self._open.items():  # (the pipeline is broken: nothing else will end them)
            queue.put_nowait(engine_failed(rid, self.dead))

    @property
    def stalled(self) -> str | None:
        """Why the engine, alive, makes no progress (a step that does not end), or None."""
        return step_stalled(self.scheduler.step_age()) if self._tasks else None

    async def stop(self) -> None:
        """Stop the actors in pipeline order, so requests still open get a final "abort"."""
        if not self._tasks:
            return
        inboxes: list[asyncio.Queue[Any]] = [self.q_tok, self.q_sched, self.q_exec, self.q_detok]
        for q, task in zip(inboxes, self._tasks):
            q.put_nowait(Shutdown())
            await asyncio.gather(task, return_exceptions=True)
        self._tasks = []
        if self.tokenizer.grammars is not None:
            self.tokenizer.grammars.close()  # its trial process (started again if the engine is)
        if self._collector_started:
            self._collector_started = False
            _collector.engine_stopped()
        close = getattr(self.runner, "close", None)  # (tensor parallelism: the other ranks exit)
        if close is not None:
            close()

    def new_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def enqueue(self, request: GenerateRequest, sink: Any) -> None:
        """Submit with no iterator: each output of the request goes to sink.put_nowait, in
        order, the last with finished=True. One sink may serve many requests (the engine
        process batches every request's outputs into one frame per loop iteration)."""
        if self.dead:
            raise RuntimeError(f"the engine is down: {self.dead}")
        self.q_detok.put_nowait(Register(request.request_id, request.params, sink))
        self.q_tok.put_nowait(Tokenize(request, time.monotonic()))

    def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        return follow(request, self._send, self._open, self.abort)

    async def _send(self, request: GenerateRequest, queue: asyncio.Queue[RequestOutput]) -> None:
        if not self._tasks:
            await self.start()
        self.enqueue(request, queue)

    def abort(self, request_id: str) -> None:
        self.q_sched.put_nowait(Abort(request_id))

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the PEFT adapter folder at `path` as `name` from now on (replace: in place of the
        adapter of that name): engine/adapters.py. RequestError, ModelLoadError."""
        await self._serving()
        await self.adapters.load(name, path, replace, self.q_sched.put_nowait)
        self.info = dataclasses.replace(self.info, loras=self.adapters.names)

    async def unload_lora(self, name: str) -> None:
        """Stop serving the adapter `name`; its open requests end with an error. LoraNotFound."""
        await self._serving()
        try:
            await self.adapters.unload(name, self.q_sched.put_nowait)
        finally:
            self.info = dataclasses.replace(self.info, loras=self.adapters.names)

    async def _serving(self) -> None:
        """Started, and with its actors alive (an update sent to a dead executor would wait forever)."""
        await self.start()
        if self.dead:
            raise RuntimeError(f"the engine is down: {self.dead}")

    async def generate(self, request: GenerateRequest) -> RequestOutput:
        """Run one request to the end; the result holds all its token ids and text."""
        return await collect(request.request_id, self.submit(request))
