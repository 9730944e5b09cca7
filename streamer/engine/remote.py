"""EngineProcess: the engine in a process of its own, behind AsyncEngine's interface.

Why: under `streamer serve` at saturation one event loop ran both the engine actors
(~21 us of CPU per streamed token) and HTTP/SSE (~23 us per token); on a slow host that
took longer than a GPU decode step, and the GPU waited. Here the server and the engine
each have an event loop, a process and a GIL of their own (as vLLM and SGLang do).

Server side (EngineProcess, in the server's process):
  Inbox:  frames from the socket: Ready (or Failed) once, then Outputs and Stats; Failed
          when the engine died; EOF when the engine process is gone.
  Outbox: Submit, Abort, Stop -> the socket; RequestOutput -> each request's own queue,
          read by submit()'s iterator (which merges what piled up, as AsyncEngine does).
  Heartbeat: every frame counts; the engine side sends one at least every IDLE_STATS_S, so
          a silence of health.HEARTBEAT_S means the engine process is stopped or its loop is
          stuck (`stalled`), and at health.FAIL_STALLED_S its open requests end (_watch).
Engine side (the spawned process, `_serve` around an AsyncEngine):
  Inbox:  Submit (-> AsyncEngine.enqueue, every request with the same sink), Abort, Stop;
          EOF (the server process went away) counts as Stop.
  Outbox: Ready once the engine has started (warm-up included), or Failed and exit;
          Outputs: every output of one event-loop iteration in one frame, never one frame
          per token; Stats after outputs (at most every STATS_INTERVAL_S) and at least
          every IDLE_STATS_S; Failed, then exit, if an engine actor crashes.
Frames: a 4-byte little-endian length, then msgpack of messages.ToEngine / FromEngine.

Invariants: every submitted request gets exactly one final output (finished=True): from
the engine, or, if the engine process dies, an error output made here; the server
process never initializes CUDA (the child is spawned, not forked: CUDA cannot be
forked); the engine process ignores SIGINT (Ctrl-C reaches the whole process group: the
server shuts down in order and sends Stop) and exits when it reads EOF; until it is ready
(while the model loads, and nothing reads the socket) it dies with the server process.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from streamer import errors
from streamer.config import EngineConfig
from streamer.engine.health import FAIL_STALLED_S, HEARTBEAT_S, step_stalled
from streamer.engine.outputs import collect, deadline_guard, engine_failed, increments
from streamer.engine.tokenizer import Tokenizer, load_tokenizer
from streamer.messages import (
    ENGINE_DOWN,
    ENGINE_STALLED,
    Abort,
    EngineStats,
    Failed,
    FromEngine,
    GenerateRequest,
    Outputs,
    Ready,
    RequestOutput,
    Stats,
    Stop,
    Submit,
    ToEngine,
)

if TYPE_CHECKING:
    # imported by the engine process alone: the server process does without the model
    # code (Triton and the kernels: ~70 MB resident)
    from streamer.engine.engine import AsyncEngine

log = logging.getLogger("streamer.engine.remote")

STATS_INTERVAL_S = 0.05
IDLE_STATS_S = 0.5
STOP_TIMEOUT_S = 15.0
"""How long stop() waits for the engine process to exit before it kills it."""

_LENGTH = struct.Struct("<I")


def _frame(encoder: msgspec.msgpack.Encoder, msg: Any) -> bytearray:
    buf = bytearray(_LENGTH.size)
    encoder.encode_into(msg, buf, _LENGTH.size)
    _LENGTH.pack_into(buf, 0, len(buf) - _LENGTH.size)
    return buf


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return await reader.readexactly(n)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _model_name(config: EngineConfig) -> str:
    """As AsyncEngine names the model, before it is loaded (serve prints it at once)."""
    return "default" if config.model == "default" else Path(config.model).expanduser().name


# ---- server side ----------------------------------------------------------------------


class EngineProcess:
    """AsyncEngine's interface as the server uses it; the engine runs in a spawned process.

    launch() starts the process and waits until its engine is ready (blocking: `streamer
    serve` calls it before uvicorn starts, so a model that fails to load is reported like
    AsyncEngine's own error); start() also connects the socket to the running event loop.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        self.model_name = _model_name(self.config)
        self.dead: str | None = None
        # from the engine process's Ready (launch)
        self.max_model_len = 0
        self.eos_token_ids: list[int] = []
        self.hf_tokenizer: Any = None
        self.tokenizer: Tokenizer | None = None
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

    def launch(self) -> None:
        """Spawn the engine process and wait (blocking) for its Ready; raise its start error."""
        if self._process is not None:
            return
        ours, theirs = socket.socketpair()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_engine_main, args=(theirs, self.config, os.getpid()), name="streamer-engine", daemon=True
        )
        self._process.start()
        theirs.close()  # only the child holds its end now: EOF on ours means the child is gone
        self._sock, self.pid = ours, self._process.pid
        try:
            (n,) = _LENGTH.unpack(_recv_exactly(ours, _LENGTH.size))
            first = self._decoder.decode(_recv_exactly(ours, n))
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
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self.eos_token_ids, self._stats = first.eos_token_ids, first.stats
        # the same tokenizer as the engine's, for what the server tokenizes itself
        self.hf_tokenizer = load_tokenizer(Path(first.model_path))
        self.tokenizer = Tokenizer(self.hf_tokenizer, first.eos_token_ids, first.max_model_len, first.vocab_size)

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
                msg = decoder.decode(await _read_frame(reader))
                self._heard = time.monotonic()
                if isinstance(msg, Outputs):
                    for out in msg.outputs:
                        q = queues.get(out.request_id)
                        if q is not None:  # (None: its consumer has gone, the request is aborted)
                            q.put_nowait(out)
                elif isinstance(msg, Stats):
                    self._stats, self._stats_at = msg.stats, self._heard
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
            self._writer.write(_frame(self._encoder, msg))

    async def stop(self) -> None:
        """Stop the engine process: requests still open end with "abort" (their final outputs
        arrive before it exits); kill it if it has not exited after STOP_TIMEOUT_S."""
        if self._process is None:
            return
        self._stopping = True
        if self._writer is not None:
            self._send(Stop())
        elif self._sock is not None:  # launched, never started
            self._sock.sendall(_frame(self._encoder, Stop()))
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

    async def submit(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self._reading is None:
            await self.start()
        if self.dead:
            raise RuntimeError(f"the engine is down: {self.dead}")
        try:
            frame = _frame(self._encoder, Submit(request))
            # read back as the engine process will: a frame it cannot decode would take it down
            self._check.decode(memoryview(frame)[_LENGTH.size :])
        except (OverflowError, msgspec.DecodeError) as e:
            # e.g. a stop token id past 64 bits (no such token exists): refused like a bad request
            yield RequestOutput(request.request_id, [], "", finished=True, finish_reason="error",
                                error=f"the request cannot be sent to the engine: {e}")
            return
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = request.request_id
        self._queues[rid] = queue
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame)
        guard = deadline_guard(request, queue, self.abort)
        finished = False
        try:
            async for out in increments(queue):
                finished = out.finished
                yield out
        finally:
            if self._queues.get(rid) is queue:  # (_watch may have ended it already)
                del self._queues[rid]
            if guard is not None:
                guard.cancel()
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine process's latest snapshot: at most STATS_INTERVAL_S old while outputs
        flow, IDLE_STATS_S otherwise."""
        if self._stats is None:
            raise RuntimeError("the engine process is not started")
        return self._stats

    async def generate(self, request: GenerateRequest) -> RequestOutput:
        """Run one request to the end; the result holds all its token ids and text."""
        return await collect(request.request_id, self.submit(request))


def _start_error(f: Failed) -> Exception:
    """The engine's start error as its own class when it is one of streamer.errors."""
    cls = getattr(errors, f.kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.StreamerError):
        return cls(f.error)
    return RuntimeError(f"the engine process failed to start: {f.kind}: {f.error}")


# ---- engine side ----------------------------------------------------------------------


def _engine_main(sock: socket.socket, config: EngineConfig, server_pid: int) -> None:
    """The engine process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _die_with_server(True)
    if os.getppid() != server_pid:  # it died before the line above
        os._exit(0)
    asyncio.run(_serve(sock, config))


def _die_with_server(on: bool) -> None:
    """Linux: the kernel kills this process when the server process dies (on), or not (off).
    On while the model loads: that holds the event loop (and, in native loaders, the GIL)
    for up to minutes with nobody reading the socket, and a server killed meanwhile used to
    leave its engine loading, holding the GPU. Off once ready: EOF then stops the engine in
    order. (The kernel watches the thread that spawned this process, and that thread waits
    in EngineProcess.launch until Ready.)"""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL if on else 0, 0, 0, 0)


class _Outbox:
    """The engine side's one writer to the socket, and the sink of every request's outputs:
    the detokenizer puts outputs, and they leave together once per loop iteration."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.encoder = msgspec.msgpack.Encoder()
        self.outputs: list[RequestOutput] = []
        self.sent_outputs = False
        """Outputs went out since the last Stats."""

    def put_nowait(self, out: RequestOutput) -> None:
        if not self.outputs:
            self.loop.call_soon(self.flush)
        self.outputs.append(out)

    def flush(self) -> None:
        if self.outputs:
            self.send(Outputs(self.outputs))
            self.outputs = []
            self.sent_outputs = True

    def send(self, msg: Any) -> None:
        # (no backpressure: a frame is one step's outputs, and the server reads at once)
        if not self.writer.is_closing():
            self.writer.write(_frame(self.encoder, msg))


async def _serve(sock: socket.socket, config: EngineConfig) -> None:
    from streamer.engine.engine import AsyncEngine  # noqa: PLC0415 - see TYPE_CHECKING above

    reader, writer = await asyncio.open_connection(sock=sock)
    outbox = _Outbox(writer)
    try:
        engine = AsyncEngine(config)
        await engine.start()
    except Exception as e:  # noqa: BLE001 - reported to the server, which raises it
        log.debug("engine start failed", exc_info=True)
        outbox.send(Failed(str(e), type(e).__name__))
        await _close(writer)
        return
    _die_with_server(False)  # from here on, EOF stops the engine in order
    outbox.send(Ready(model_path=str(engine.model_path), model_name=engine.model_name,
                      max_model_len=engine.max_model_len, vocab_size=engine.tokenizer.vocab_size,
                      eos_token_ids=engine.eos_token_ids, stats=engine.stats()))
    commands = asyncio.create_task(_obey(reader, engine, outbox))
    reports = asyncio.create_task(_report(engine, outbox))
    done, _ = await asyncio.wait([commands, reports], return_when=asyncio.FIRST_COMPLETED)
    commands.cancel()
    reports.cancel()
    if engine.dead:
        outbox.send(Failed(engine.dead))
    await engine.stop()  # open requests end with "abort"
    outbox.flush()
    await _close(writer)
    for task in done:
        task.result()  # a bug in this module: its traceback, and a non-zero exit status


async def _obey(reader: asyncio.StreamReader, engine: AsyncEngine, outbox: _Outbox) -> None:
    """Run the server's commands until Stop or EOF."""
    decoder = msgspec.msgpack.Decoder(ToEngine)
    while True:
        try:
            msg = decoder.decode(await _read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the server process is gone
        if isinstance(msg, Submit):
            if engine.dead:
                return
            engine.enqueue(msg.request, outbox)
        elif isinstance(msg, Abort):
            engine.abort(msg.request_id)
        else:
            return


async def _report(engine: AsyncEngine, outbox: _Outbox) -> None:
    """Stats after outputs and when idle, until an engine actor crashes."""
    last = time.monotonic()
    while not engine.dead:
        await asyncio.sleep(STATS_INTERVAL_S)
        now = time.monotonic()
        if outbox.sent_outputs or now - last >= IDLE_STATS_S:
            outbox.send(Stats(engine.stats()))
            outbox.sent_outputs, last = False, now


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    except ConnectionError:
        pass
