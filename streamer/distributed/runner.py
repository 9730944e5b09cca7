"""The ModelRunner of each tensor-parallel rank.

Rank 0 (TPRunner) is the engine's runner: before each step's forward it broadcasts the
step (step.py), then runs the same forward as every rank on its shard; it samples alone and
broadcasts the sampled token ids, which the next step may read on the device (packing.py's
pending rows). The host tier (the scheduler's, rank 0's) logs its copies between device and
host pages; each step sends them, every rank starts them on its shard, and waits for a load
only at the step rank 0 may read its pages in (TierFollower). A
speculative draft (draft_model, eagle3) is whole and on rank 0 alone: it
proposes before the step is sent, so the other ranks receive the verify chunks' tokens. The other ranks (follow_steps) run each step they receive and take the
tokens; they never schedule nor sample. A LoRA adapter loaded or unloaded while serving goes
to them between two steps (RankLora): each rank reads the folder, and all agree on the outcome.

Invariant: every rank issues the same collectives in the same order (same batch, same
code). A step that fails on rank 0 may leave the others inside a collective: it is fatal
to the engine (`failed`), not one step's error.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from streamer.distributed.step import StepChannel, for_ranks
from streamer.errors import ModelLoadError
from streamer.frames import RankLora, RankStep, RankStop, TierCopy
from streamer.kv.host import HostTier
from streamer.messages import Batch, LoraUpdate
from streamer.model.launched import Launched, RowValues
from streamer.model.runner import ModelRunner, row_ids
from streamer.model.tp_group import TPGroup

log = logging.getLogger("streamer.distributed")


class TPRunner(ModelRunner):
    def __init__(self, config: Any, model_path: str, diagnostics: Any, group: TPGroup, workers: Any) -> None:
        self.group = group
        self.workers = workers
        """launch.Workers: this node's other ranks (their processes)."""
        self.failed: str | None = None
        self._on_failure: Callable[[str], None] | None = None
        self._closed = False
        self._fail_lock = threading.Lock()
        super().__init__(config, model_path, diagnostics)
        if config.host_kv_cache_gb:  # (the scheduler's host tier logs its copies here)
            self.pool.tier_log = deque()
        self.loads_ready = 0
        """How many of the tier's loads rank 0 has seen complete (RankStep.loads_ready)."""
        self.channel = StepChannel(group)
        self.channel.start_keepalive()
        workers.watch(self.fail)

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """on_failure(why) once, from any thread, when a rank dies or a step breaks the group."""
        with self._fail_lock:
            self._on_failure = on_failure
            failed = self.failed
        if failed is not None:
            on_failure(failed)

    def fail(self, why: str) -> None:
        with self._fail_lock:
            if self.failed is not None or self._closed:
                return
            self.failed = why
            sink = self._on_failure
        log.error("tensor parallelism: %s; the engine stops", why)
        self.workers.terminate()
        if sink is not None:
            sink(why)

    def _launch(self, batch: Batch) -> Launched:
        if self.failed is not None:
            raise RuntimeError(f"the tensor-parallel group is down: {self.failed}")
        try:
            return super()._launch(batch)
        except Exception as e:
            raise RuntimeError(self._broken(batch, e)) from e

    def before_forward(self, batch: Batch) -> None:
        # (after the draft's proposals, which only rank 0 draws, are in the batch)
        copies = []
        log = self.pool.tier_log
        while log:  # (the scheduler's thread may append meanwhile: the rest goes with the next step)
            copies.append(log.popleft())
        loads = self.pool.tier_loads
        # (loads complete in their order: one copy stream; a request reads its pages only once
        # the scheduler saw its load complete, before this)
        while loads and (loads[0] is None or loads[0].query()):
            loads.popleft()
            self.loads_ready += 1
        self.channel.send(RankStep(for_ranks(batch), self.split_decode_tokens, copies, self.loads_ready))

    def update_lora(self, update: LoraUpdate) -> None:
        """Every rank loads (reads the folder itself) or unloads the adapter; then they agree, or
        every rank leaves its adapters as they were and the error is raised here."""
        if self.failed is not None:
            raise RuntimeError(f"the tensor-parallel group is down: {self.failed}")
        self.channel.send(RankLora(update.key, update.name, update.path))
        error: Exception | None = None
        try:
            super().update_lora(update)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised
            error = e
        if self.group.min_int(int(error is None)) == 1:
            return
        if error is None:  # another rank failed: this one undoes its load
            self.adapters.update(update.key, None)
            error = ModelLoadError(f"LoRA adapter {update.name!r}: another tensor-parallel rank could not load "
                                   f"{update.path} (a folder every node must be able to read)")
        raise error

    def _sample(self, batch: Batch, logits: torch.Tensor, values: RowValues,
                plan: Any = None, proposed: Any = None) -> Launched:
        try:
            out = super()._sample(batch, logits, values, plan, proposed)
            if self.last_tokens.numel():  # (the same count on every rank: all skip it, or none)
                self.group.broadcast(self.last_tokens.to(torch.long).contiguous())
        except Exception as e:
            raise RuntimeError(self._broken(batch, e)) from e
        return out

    def _broken(self, batch: Batch, e: Exception) -> str:
        """A step failed on rank 0: the group is out of step; why (naming a rank that died)."""
        why = self.workers.why(f"step {batch.step} failed on rank 0: {e}")
        self.fail(why)
        return self.failed or why

    def close(self) -> None:
        """Stop the other ranks (in order where they are alive) and leave the group."""
        from streamer.model.tp_group import leave

        if self._closed:
            return
        self.channel.stop_keepalive()
        with self._fail_lock:
            self._closed = True
            failed = self.failed
        if failed is None:
            try:
                self.channel.send(RankStop())
            except Exception:  # noqa: BLE001 - a rank died meanwhile: terminated below
                log.warning("tensor parallelism: a rank was gone at stop", exc_info=True)
        self.workers.close()
        leave()


@torch.inference_mode()
def follow_steps(runner: ModelRunner, channel: StepChannel, tier: HostTier | None = None) -> None:
    """A rank other than 0: run every step rank 0 sends, until RankStop; first the host
    tier's copies rank 0 made since the last step, the same on this rank's shard (tier)."""
    group = channel.group
    copies = None if tier is None else TierFollower(tier)
    while True:
        msg = channel.recv()
        if isinstance(msg, RankStop):
            return
        if isinstance(msg, RankLora):
            _follow_lora(runner, group, msg)
            continue
        if not isinstance(msg, RankStep):
            continue  # a keep-alive
        if msg.tier_copies or msg.loads_ready:
            assert copies is not None, "host tier copies without a host tier"
            copies.follow(msg.tier_copies, msg.loads_ready)
        batch = msg.batch
        runner.split_decode_tokens = msg.split_decode_tokens
        runner.forward(batch)
        rids = row_ids(batch)  # (a verify chunk samples at each of its 1 + k positions)
        tokens = torch.empty(len(rids), dtype=torch.long, device=runner.device)
        if rids:
            group.broadcast(tokens)
        runner.last_tokens, runner.last_rows = tokens, {rid: i for i, rid in enumerate(rids)}


def _follow_lora(runner: ModelRunner, group: TPGroup, msg: RankLora) -> None:
    """Rank 0's adapter update on this rank (TPRunner.update_lora), agreed on by every rank."""
    from streamer.model.lora import read_adapter

    ok = True
    try:
        runner.adapters.update(msg.key, None if msg.path is None else read_adapter(msg.name, msg.path))
    except Exception:  # noqa: BLE001 - rank 0 reports it to the caller
        log.warning("tensor parallelism: LoRA adapter %r not loaded on this rank", msg.name, exc_info=True)
        ok = False
    if group.min_int(int(ok)) == 0 and ok and msg.path is not None:
        runner.adapters.update(msg.key, None)


class TierFollower:
    """A rank other than 0's shard of the host tier: rank 0's copies, in its order, on this
    rank's pages. Write-backs: the step that follows waits for their gathers (it may reuse the
    pages they free), as rank 0's does. Loads run on beside the steps until rank 0 says a step
    may read their pages (loads_ready); that step waits for them."""

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self.loads: deque[Any] = deque()
        """This rank's load events not yet waited for, in their order."""
        self.waited = 0

    def follow(self, copies: list[TierCopy], loads_ready: int) -> None:
        tier = self.tier
        for c in copies:
            if c.write_back:
                tier.write(c.gpu, c.host)
            else:
                self.loads.append(tier.load(c.host, c.gpu))
        stream = torch.cuda.current_stream() if tier.cuda else None
        if stream is not None and copies and tier.pool.fence is not None:
            stream.wait_event(tier.pool.fence)
        while self.waited < loads_ready:
            event = self.loads.popleft()
            if stream is not None and event is not None:
                stream.wait_event(event)
            self.waited += 1
