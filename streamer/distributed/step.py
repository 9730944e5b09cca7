"""The step broadcast: rank 0 -> every other rank, one message per step (frames.ToRank).

A message is msgpack (msgspec) in a uint8 tensor broadcast on the control group (gloo, CPU:
no device synchronization). The tensor has a fixed size, HEAD_BYTES, so that one broadcast
carries a step: its first 8 bytes are the message's length, the rest its start; a longer
message (a large batch's page tables) follows in a second broadcast of exactly the rest.

Invariants: rank 0 sends from one thread at a time (the lock: the launch thread's steps and
the keep-alive thread's pings); the other ranks receive in their one thread, in order.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from streamer.frames import RankPing, RankStep, ToRank
from streamer.messages import Batch
from streamer.model.tp_group import COUNTS, KEEPALIVE_S, TPGroup

HEAD_BYTES = 64 << 10
LEN = 8


def for_ranks(batch: Batch) -> Batch:
    """What the other ranks need of a batch: not its sampling fields (rank 0 samples)."""
    return msgspec.structs.replace(batch, params=[], histories=[], banned=[], masks=None)


class StepChannel:
    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
        self.view = self.head.numpy()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ToRank)
        self.lock = threading.Lock()
        self.last_sent = time.monotonic()
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None

    # ---- rank 0 -----------------------------------------------------------------------------
    def send(self, msg: ToRank) -> None:
        buf = bytearray(LEN)
        self.encoder.encode_into(msg, buf, LEN)
        n = len(buf) - LEN
        buf[:LEN] = n.to_bytes(LEN, "little")
        first = min(len(buf), HEAD_BYTES)
        with self.lock:
            self.view[:first] = np.frombuffer(buf, dtype=np.uint8, count=first)
            dist.broadcast(self.head, src=0, group=self.group.control)
            if len(buf) > HEAD_BYTES:
                rest = torch.frombuffer(buf[HEAD_BYTES:], dtype=torch.uint8)
                dist.broadcast(rest, src=0, group=self.group.control)
            self.last_sent = time.monotonic()
        if isinstance(msg, RankStep):
            COUNTS["step"] += 1

    def start_keepalive(self) -> None:
        def ping() -> None:
            while not self._stop.wait(KEEPALIVE_S / 4):
                if time.monotonic() - self.last_sent >= KEEPALIVE_S:
                    try:
                        self.send(RankPing())
                    except Exception:  # noqa: BLE001 - a rank is gone: the watchdog reports it
                        return

        self._keepalive = threading.Thread(target=ping, name="streamer-tp-keepalive", daemon=True)
        self._keepalive.start()

    def stop_keepalive(self) -> None:
        self._stop.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=5)

    # ---- the other ranks --------------------------------------------------------------------
    def recv(self) -> ToRank:
        dist.broadcast(self.head, src=0, group=self.group.control)
        n = int.from_bytes(self.view[:LEN].tobytes(), "little")
        data = self.view[LEN : min(LEN + n, HEAD_BYTES)].tobytes()
        if LEN + n > HEAD_BYTES:
            rest = torch.empty(LEN + n - HEAD_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group.control)
            data += rest.numpy().tobytes()
        return self.decoder.decode(data)
