"""The engine side of EngineProcess (engine/remote.py): the spawned process's main, around an
AsyncEngine, and the frame format both sides use.

  Inbox:  Submit (-> AsyncEngine.enqueue, every request with the same sink), Abort, Lora (->
          AsyncEngine.load_lora / unload_lora, answered by a LoraDone), Stop;
          EOF (the server process went away) counts as Stop.
  Outbox: Ready once the engine has started (warm-up included), or Failed and exit;
          Outputs: every output of one event-loop iteration in one frame, never one frame
          per token; Stats after outputs (at most every STATS_INTERVAL_S) and at least
          every IDLE_STATS_S (the server's heartbeat); Failed, then exit, if an engine actor
          crashes.
  Frames: a 4-byte little-endian length, then msgpack of frames.ToEngine / FromEngine.

Invariants: the process ignores SIGINT (Ctrl-C reaches the whole process group: the server
shuts down in order and sends Stop) and exits when it reads EOF; until it is ready (while
the model loads, and nothing reads the socket) it dies with the server process. This
module imports the model code only inside the process (_serve): the server process imports
it for the frame format and the spawn target.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import struct
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from streamer.config import EngineConfig
from streamer.errors import StreamerError
from streamer.frames import Failed, Lora, LoraDone, Outputs, Ready, Stats, Submit, ToEngine
from streamer.messages import Abort, RequestOutput

if TYPE_CHECKING:
    # imported by the engine process alone: the server process does without the model
    # code (Triton and the kernels: ~70 MB resident)
    from streamer.engine.engine import AsyncEngine

log = logging.getLogger("streamer.engine.remote")

STATS_INTERVAL_S = 0.05
IDLE_STATS_S = 0.5

LENGTH = struct.Struct("<I")


def frame(encoder: msgspec.msgpack.Encoder, msg: Any) -> bytearray:
    buf = bytearray(LENGTH.size)
    encoder.encode_into(msg, buf, LENGTH.size)
    LENGTH.pack_into(buf, 0, len(buf) - LENGTH.size)
    return buf


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    return await reader.readexactly(n)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


# ---- the engine process -----------------------------------------------------------------


def engine_main(sock: socket.socket, config: EngineConfig, server_pid: int) -> None:
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
            self.writer.write(frame(self.encoder, msg))


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
    info = engine.info
    outbox.send(Ready(model_path=str(engine.model_path), model_name=info.name, max_model_len=info.max_model_len,
                      vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids, stats=engine.stats()))
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
            msg = decoder.decode(await read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the server process is gone
        if isinstance(msg, Submit):
            if engine.dead:
                return
            engine.enqueue(msg.request, outbox)
        elif isinstance(msg, Abort):
            engine.abort(msg.request_id)
        elif isinstance(msg, Lora):
            asyncio.create_task(_update_lora(engine, msg, outbox))  # (steps go on meanwhile)
        else:
            return


async def _update_lora(engine: AsyncEngine, msg: Lora, outbox: _Outbox) -> None:
    try:
        if msg.path is None:
            await engine.unload_lora(msg.name)
        else:
            await engine.load_lora(msg.name, msg.path, msg.replace)
    except Exception as e:  # noqa: BLE001 - the server's caller gets it (not one of streamer.errors: a RuntimeError)
        if not isinstance(e, StreamerError):
            log.warning("LoRA adapter %r: update failed", msg.name, exc_info=True)
        outbox.send(LoraDone(msg.id, list(engine.info.loras), str(e), type(e).__name__))
    else:
        outbox.send(LoraDone(msg.id, list(engine.info.loras)))


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
