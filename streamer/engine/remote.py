"""EngineProcess: the engine in a process of its own, behind the same interface as
AsyncEngine (engine/protocol.py's Engine).

Why: under `streamer serve` at saturation one event loop ran both the engine actors
(~21 us of CPU per streamed token) and HTTP/SSE (~23 us per token); on a slow host that
took longer than a GPU decode step, and the GPU waited. Here the server and the engine
each have an event loop, a process and a GIL of their own (as vLLM and SGLang do).

This module is the server side, in the server's process; the engine side (the spawned
process around an AsyncEngine, and the frame format) is engine/remote_engine.py.
  Inbox:  frames from the socket: Ready (or Failed) once, then Outputs and Stats; Failed
          when the engine died; EOF when the engine process is gone.
  Outbox: Submit, Abort, Stop -> the socket; RequestOutput -> each request's own queue,
          read by submit()'s iterator (outputs.follow, as AsyncEngine's).
  Heartbeat: every frame counts; the engine side sends one at least every IDLE_STATS_S, so
          a silence of health.HEARTBEAT_S means the engine process is stopped or its loop is
          stuck (`stalled`), and at health.FAIL_STALLED_S its open requests end (_watch).

Invariants: every submitted request gets exactly one final output (finished=True): from
the engine, or, if the engine process dies, an error output made here; the server
process never initializes CUDA (the child is spawned, not forked: CUDA cannot be
forked), nor tokenizes for the engine (its tokenizer serves /tokenize and logprobs' text).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import msgspec

from streamer import errors
from streamer.config import EngineConfig
from streamer.engine.generation_config import generation_defaults
from streamer.engine.health import FAIL_STALLED_S, HEARTBEAT_S, step_stalled
from streamer.engine.outputs import collect, engine_failed, follow
from streamer.engine.pooling import pooling_config
from streamer.engine.protocol import ModelInfo
from streamer.engine.remote_engine import LENGTH, engine_main, frame, read_frame, recv_exactly
from streamer.engine.tokenizer import load_tokenizer
from streamer.engine_stats import EngineStats
from streamer.frames import Failed, FromEngine, Lora, LoraDone, Outputs, Ready, Stats, Stop, Submit, ToEngine
from streamer.messages import ENGINE_DOWN, ENGINE_STALLED, Abort, GenerateRequest, RequestOutput
from streamer.model.source import model_name

log = logging.getLogger("streamer.engine.remote")

STOP_TIMEOUT_S = 15.0
"""How long stop() waits for the engine process to exit before it kills it."""


def _model_name(config: EngineConfig) -> str:
    """As AsyncEngine names the model, before it is loaded (serve prints it at once)."""
    return model_name(config.model)


class EngineProcess:
    """The Engine interface; the engine runs in a spawned process.

    launch() starts the process and waits until its engine is ready (blocking: `streamer
    serve` calls it before uvicorn starts, so a model that fails to load is reported like
    AsyncEngine's own error); start() also connects the socket to the running event loop.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        self.model_name = _model_name(self.config)
        """The model's name before launch (`streamer serve` prints it); then info.name."""
        self.dead: str | None = None
        self._info: ModelInfo | None = None
        """From the engine process's Ready (launch)."""
        self.pid: int | None = None
        self._process: Any = None  # multiprocessing's SpawnProcess
        self._sock: socket.socket | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._watching: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._stats: EngineStats | None = None
        self._heard = 0.0
        """time.monotonic() of the last frame from the engine process (its heartbeat)."""
        self._stats_at = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._check = msgspec.msgpack.Decoder(ToEngine)
        self._stopping = False
        self._counter = 0
        self._lora_waits: dict[int, asyncio.Future[LoraDone]] = {}
        """Lora frames sent, by id, waiting for their LoraDone."""
        self.env: dict[str, str] = {}
        """Environment variables the engine process starts with, over this process's (a
        data-parallel replica's devices: router/devices.py)."""

    def launch(self) -> None:
        """Spawn the engine process and wait (blocking) for its Ready; raise its start error."""
        if self._process is not None:
            return
        ours, theirs = socket.socketpair()
        self._process = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(theirs, self.config, os.getpid()), name="streamer-engine", daemon=True
        )
        with _environment(self.env):  # (a spawned child inherits os.environ as it is at start)
            self._process.start()
        theirs.close()  # only the child holds its end now: EOF on ours means the child is gone
        self._sock, self.pid = ours, self._process.pid
        try:
            (n,) = LENGTH.unpack(recv_exactly(ours, LENGTH.size))
            first = self._decoder.decode(recv_exactly(ours, n))
        except EOFError:
            self._process.join(5)
            status = self._process.exitcode
            self._close()
            raise RuntimeError(f"the engine process exited (status {status}) before it was ready") from None
        if isinstance(first, Failed):
            self._process.join(STOP_TIMEOUT_S)
            self._close()
            raise _start_error(first)
        assert isinstance(first, Ready)
        self.model_name, self._stats = first.model_name, first.stats
        # the engine's own tokenizer, for /tokenize and the text of logprobs' tokens
        hf = load_tokenizer(Path(first.model_path), self.config.chat_template)
        self._info = ModelInfo(first.model_name, first.max_model_len, first.vocab_size, first.eos_token_ids, hf,
                               generation_defaults=generation_defaults(Path(first.model_path)),
                               chat_template_kwargs=dict(self.config.default_chat_template_kwargs or {}),
                               pooling=pooling_config(Path(first.model_path)),
                               loras=tuple(name for name, _ in self.config.lora_adapters))

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("the engine process is not launched")
        return self._info

    async def start(self) -> None:
        if self._reading is not None:
            return
        if self._process is None:
            await asyncio.to_thread(self.launch)
        reader, self._writer = await asyncio.open_connection(sock=self._sock)
        self._heard = self._stats_at = time.monotonic()
        self._reading = asyncio.create_task(self._read(reader), name="streamer-engine-process")
        self._watching = asyncio.create_task(self._watch(), name="streamer-engine-watch")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        queues, decoder = self._queues, self._decoder
        try:
            while True:
                msg = decoder.decode(await read_frame(reader))
                self._heard = time.monotonic()
                if isinstance(msg, Outputs):
                    for out in msg.outputs:
                        q = queues.get(out.request_id)
                        if q is not None:  # (None: its consumer has gone, the request is aborted)
                            q.put_nowait(out)
                elif isinstance(msg, Stats):
                    self._stats, self._stats_at = msg.stats, self._heard
                elif isinstance(msg, LoraDone):
                    wait = self._lora_waits.pop(msg.id, None)
                    if wait is not None and not wait.done():
                        wait.set_result(msg)
                elif isinstance(msg, Failed):
                    reason = msg.error
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._stopping:  # (stop() joins it)
                await asyncio.to_thread(self._process.join, 2)
            reason = f"the engine process exited (status {self._process.exitcode})"
        except msgspec.DecodeError as e:  # a bug: nothing else can be trusted on this socket
            reason = f"a bad frame from the engine process: {e}"
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        """The engine is gone: every request still open ends with an error."""
        if not self._stopping:
            self.dead = reason
            log.error("engine down: %s", reason)
        for rid, q in self._queues.items():
            q.put_nowait(engine_failed(rid, reason, ENGINE_DOWN))
        for wait in self._lora_waits.values():
            if not wait.done():
                wait.set_exception(RuntimeError(f"the engine is down: {reason}"))
        self._lora_waits.clear()

    @property
    def stalled(self) -> str | None:
        """Why the engine process, alive, makes no progress (None: it does): no frame for
        HEARTBEAT_S, or a step in flight for STEP_STALL_S (by its latest Stats)."""
        if self._reading is None or self.dead:
            return None
        now = time.monotonic()
        silent = now - self._heard
        if silent >= HEARTBEAT_S:
            return f"no heartbeat from the engine process for {silent:.1f} s"
        age = self._stats.step_age_s if self._stats is not None else 0.0
        return step_stalled(age + now - self._stats_at) if age else None

    async def _watch(self) -> None:
        """End the open requests once the engine process has been silent FAIL_STALLED_S."""
        while True:
            await asyncio.sleep(0.5)
            silent = time.monotonic() - self._heard
            if silent < FAIL_STALLED_S or not self._queues:
                continue
            reason = f"no heartbeat from the engine process for {silent:.0f} s"
            log.error("engine stalled: %s; failing %d open requests", reason, len(self._queues))
            for rid, q in self._queues.items():
                q.put_nowait(engine_failed(rid, reason, ENGINE_STALLED))
                self._send(Abort(rid))  # (read once it runs again: their pages come back)
            self._queues.clear()

    def _send(self, msg: Any) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(self._encoder, msg))

    async def stop(self) -> None:
        """Stop the engine process: requests still open end with "abort" (their final outputs
        arrive before it exits); kill it if it has not exited after STOP_TIMEOUT_S."""
        if self._process is None:
            return
        self._stopping = True
        if self._writer is not None:
            self._send(Stop())
        elif self._sock is not None:  # launched, never started
            self._sock.sendall(frame(self._encoder, Stop()))
        await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.warning("the engine process did not exit in %.0f s: killed", STOP_TIMEOUT_S)
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        if self._reading is not None:
            try:  # the last outputs, then EOF
                await asyncio.wait_for(self._reading, 5)
            except TimeoutError:
                self._fail("stopped")
        self._close()

    def _close(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None
        if self._writer is not None:
            self._writer.close()
        elif self._sock is not None:
            self._sock.close()
        self._process = self._sock = self._writer = self._reading = None

    def new_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        return follow(request, self._send_request, self._queues, self.abort)

    async def _send_request(self, request: GenerateRequest, queue: asyncio.Queue[RequestOutput]) -> None:
        if self._reading is None:
            await self.start()
        if self.dead:
            raise RuntimeError(f"the engine is down: {self.dead}")
        try:
            data = frame(self._encoder, Submit(request))
            # read back as the engine process will: a frame it cannot decode would take it down
            self._check.decode(memoryview(data)[LENGTH.size :])
        except (OverflowError, msgspec.DecodeError) as e:
            # e.g. a stop token id past 64 bits (no such token exists): refused like a bad request
            queue.put_nowait(RequestOutput(request.request_id, [], "", finished=True, finish_reason="error",
                                           error=f"the request cannot be sent to the engine: {e}"))
            return
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine process's latest snapshot: at most remote_engine.STATS_INTERVAL_S old while outputs
        flow, IDLE_STATS_S otherwise."""
        if self._stats is None:
            raise RuntimeError("the engine process is not started")
        return self._stats

    @property
    def stats_received_at(self) -> float:
        """time.monotonic() when stats() arrived. A snapshot received after an output was
        made after it (one ordered socket), so it counts that output's request."""
        return self._stats_at

    async def generate(self, request: GenerateRequest) -> RequestOutput:
        """Run one request to the end; the result holds all its token ids and text."""
        return await collect(request.request_id, self.submit(request))

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """AsyncEngine.load_lora in the engine process."""
        await self._lora(name, path, replace)

    async def unload_lora(self, name: str) -> None:
        """AsyncEngine.unload_lora in the engine process."""
        await self._lora(name, None, False)

    async def _lora(self, name: str, path: str | None, replace: bool) -> None:
        await self.start()
        if self.dead:
            raise RuntimeError(f"the engine is down: {self.dead}")
        self._counter += 1
        wait = self._lora_waits[self._counter] = asyncio.get_running_loop().create_future()
        self._send(Lora(self._counter, name, path, replace))
        done = await wait
        self._info = dataclasses.replace(self.info, loras=tuple(done.loras))
        if done.error is not None:
            raise _error(done.kind, done.error)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    # (one at a time: replicas launch from threads of their own, each with its devices)
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_ENV_LOCK = threading.Lock()


def _start_error(f: Failed) -> Exception:
    """The engine's start error as its own class when it is one of streamer.errors."""
    return _error(f.kind, f.error, "the engine process failed to start: ")


def _error(kind: str, error: str, context: str = "") -> Exception:
    """An engine process's error as its own class when it is one of streamer.errors."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.StreamerError):
        return cls(error)
    return RuntimeError(f"{context}{kind}: {error}")
