"""AheadClock: when to schedule the batch after the running one (overlap, hold-ahead).

Driven by the actor loop alone (on_send, on_output, hold_until); the policy never reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamer.messages import Batch, StepOutput

if TYPE_CHECKING:
    from streamer.engine.scheduler.policy import Scheduler


class AheadClock:
    """When to schedule the batch after the running one (overlap).

    Scheduled at once, it queues on the GPU behind the running step, and a request that
    arrives meanwhile waits for both. While only decodes run, nobody waits and a new request
    could be admitted, it is better scheduled just before the running step ends: an arrival
    until then joins it. The end is predicted from the device time of recent decode steps
    (StepOutput.device_time), counted from when the step could start (the output before it,
    or its own sending). The margin covers the host's time to build and launch the next
    batch; it grows whenever a held batch reached the device late (StepOutput.idle_before)
    and decays with every decode step. A margin past half the step is not worth holding for.
    """

    def __init__(self, margin_s: float) -> None:
        self.margin = margin_s
        self.extra = 0.0
        """Learned on top of margin: how late held batches were."""
        self.decode_s: float | None = None
        """Moving average of the device time of a decode-only step."""
        self.sent: dict[int, float] = {}
        self.held_steps: set[int] = set()
        self.last_out = 0.0
        self.held = 0
        """Batches scheduled after a hold."""
        self.joined = 0
        """Of those, batches that admitted a request arriving during the hold."""
        self.late = 0
        """Of those, batches that reached the device after it had gone idle."""

    def on_send(self, batch: Batch, now: float, held: bool = False) -> None:
        self.sent[batch.step] = now
        if held:
            self.held_steps.add(batch.step)
            self.held += 1

    def on_output(self, batch: Batch, out: StepOutput, now: float) -> None:
        self.sent.pop(batch.step, None)
        self.last_out = now
        if batch.step in self.held_steps:
            self.held_steps.discard(batch.step)
            if out.idle_before > 5e-5:
                self.late += 1
                self.extra += out.idle_before + 2e-4
        if out.error is None and out.device_time > 0 and decode_only(batch):
            self.extra *= 0.98  # (so a slow patch, such as the warm-up's, is forgotten in ~100 steps)
            d = out.device_time
            self.decode_s = d if self.decode_s is None else 0.7 * self.decode_s + 0.3 * d

    def hold_until(self, running: Batch, sched: Scheduler) -> float | None:
        """When to schedule the batch after `running`; None: now."""
        if self.margin <= 0 or self.decode_s is None or sched.waiting or not decode_only(running):
            return None
        if len(sched.running) >= sched.config.max_num_seqs:
            return None  # a request arriving now could not join anyway
        margin = self.margin + self.extra
        if margin > self.decode_s / 2:
            return None  # too short a step (or too slow a host) to be worth holding the next one
        start = max(self.sent.get(running.step, 0.0), self.last_out)
        return start + self.decode_s - margin

    def step_age(self, now: float) -> float:
        """Seconds the oldest batch in flight has been with the executor (0: none)."""
        return now - min(self.sent.values()) if self.sent else 0.0


def decode_only(batch: Batch) -> bool:
    return all(len(s.token_ids) == 1 for s in batch.seqs)
