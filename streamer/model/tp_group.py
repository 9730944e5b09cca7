"""The tensor-parallel group of this process: its rank, its two torch.distributed process
groups, and the collectives the sharded layers call.

  data group     the default group: NCCL on CUDA, gloo on CPU. Activations: the all-reduce
                 after each row-parallel layer and the vocab-parallel embedding, the
                 all-gather of the LM head's logits, the broadcast of each step's tokens.
                 Its timeout (COLLECTIVE_TIMEOUT_S) bounds a collective whose peer is gone.
  control group  gloo, CPU tensors: the step broadcast (step.py) and the start-up
                 agreement on the pool's size. Worker ranks wait on it between steps, for
                 as long as the engine is idle: rank 0 sends a keep-alive every
                 KEEPALIVE_S, well inside its timeout (CONTROL_TIMEOUT_S).

`current()` is None in an engine of one rank: the layers then hold whole weights and call
no collective (the single-GPU path is what it was). Every collective here is a plain
torch.distributed call on the current stream, so a CUDA graph captured on NCCL replays it
(the communicator is made before any capture: `TPGroup.__init__` runs one all-reduce).

COUNTS counts the collectives issued from Python (tests read it per step; a replayed CUDA
graph issues its captured collectives without passing here).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 300.0
"""A data collective waits this long for a peer (a dead peer on NCCL shows as a timeout;
gloo also notices a closed connection at once). Far above any step's skew between ranks."""
CONTROL_TIMEOUT_S = 3600.0
KEEPALIVE_S = 60.0

COUNTS: collections.Counter[str] = collections.Counter()
"""Collectives issued from Python in this process, by name: all_reduce, all_gather,
broadcast (the data group's; the control group's messages are step.py's)."""


@dataclass(slots=True)
class TPGroup:
    rank: int
    size: int
    local_rank: int
    """This rank's index on its node (its CUDA device offset)."""
    device: torch.device
    control: dist.ProcessGroup = field(repr=False)
    data: dist.ProcessGroup | None = field(default=None, repr=False)
    """None: the default group."""

    # ---- what a rank holds ----------------------------------------------------------------
    def heads(self, heads: int, kv_heads: int) -> tuple[int, int, int, int]:
        """(local query heads, local KV heads, first query head, first KV head). KV heads are
        split like the query heads, or, where there are fewer of them than ranks, each is
        replicated on size // kv_heads consecutive ranks (the ranks whose query heads use it)."""
        q = heads // self.size
        if kv_heads >= self.size:
            kv = kv_heads // self.size
            return q, kv, self.rank * q, self.rank * kv
        return q, 1, self.rank * q, self.rank // (self.size // kv_heads)

    def split(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's share of n (n divisible by size)."""
        k = n // self.size
        return self.rank * k, k

    def vocab(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows held: padded, rows that exist) of this rank's vocabulary shard."""
        per = -(-vocab // self.size)
        first = self.rank * per
        return first, per, max(0, min(vocab, first + per) - first)

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        COUNTS["all_reduce"] += 1
        dist.all_reduce(x, group=self.data)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max over ranks, in place (load time: float8 scales of split rows)."""
        COUNTS["all_reduce_max"] += 1
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.data)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., n * size], rank 0's columns first."""
        COUNTS["all_gather"] += 1
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.data)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x to every rank, in place."""
        COUNTS["broadcast"] += 1
        dist.broadcast(x, src=0, group=self.data)
        return x

    def min_int(self, n: int) -> int:
        """The smallest of every rank's n (on the control group: a start-up agreement)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


_current: TPGroup | None = None


def current() -> TPGroup | None:
    """The group of the model being built in this process, or None (one rank: nothing is
    sharded). Read while a runner is built (layers, loader, pool): modules keep what they
    read, so an engine of one rank built beside a tensor-parallel one stays whole."""
    return _current


@contextlib.contextmanager
def building(group: TPGroup) -> Iterator[None]:
    """The models and pools built inside are group's shards."""
    global _current
    _current = group
    try:
        yield
    finally:
        _current = None


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """The models built inside are whole, on whichever rank builds them (a speculative draft:
    rank 0 alone runs it, with no collective)."""
    global _current
    saved, _current = _current, None
    try:
        yield
    finally:
        _current = saved


def init(rank: int, size: int, local_rank: int, device: torch.device, store: dist.Store) -> TPGroup:
    """Join the group (every rank calls this, in any order; it returns once all have)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    group = TPGroup(rank, size, local_rank, device, control)
    if device.type == "cuda":
        # the NCCL communicator is made at its first collective, which must not be inside a
        # CUDA graph's capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return group


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
