"""The executor actor against a scripted runner: outputs leave in step order whatever
order the waits end in; a batch with deferred masks samples only when its MaskFill
arrives; a step that fails becomes an error output and the actor keeps going."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import torch

from streamer.engine import executor
from streamer.messages import Batch, MaskFill, SampledToken, StepOutput
from streamer.model.runner import Launched


class ScriptedRunner:
    """launch/sample/collect with the runner's contract; collect of some steps is slow,
    and launching a step listed in `fail` raises."""

    def __init__(self, slow: set[int] = frozenset(), fail: set[int] = frozenset()) -> None:
        self.slow, self.fail = slow, fail
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def _log(self, what: str, step: int) -> None:
        with self.lock:
            self.events.append((what, step))

    def launch(self, batch: Batch) -> Launched:
        self._log("launch", batch.step)
        if batch.step in self.fail:
            raise RuntimeError(f"boom in step {batch.step}")
        if batch.masks_deferred:
            return Launched(batch.step, None, None, {}, batch=batch)  # awaiting its masks
        return Launched(batch.step, torch.tensor([batch.step]), None, {})

    def sample(self, launched: Launched, masks) -> Launched:
        self._log("sample", launched.step)
        assert masks == f"mask-{launched.step}"
        return Launched(launched.step, torch.tensor([100 + launched.step]), None, {})

    def collect(self, launched: Launched) -> StepOutput:
        if launched.step in self.slow:
            time.sleep(0.05)
        self._log("collect", launched.step)
        assert launched.tokens is not None
        return StepOutput(launched.step, [SampledToken(t) for t in launched.tokens.tolist()])


def batch(step: int, deferred: bool = False) -> Batch:
    return Batch(step, [], [], [], [], masks_deferred=deferred)


async def drive(runner: ScriptedRunner, messages: list, expect: int) -> list[StepOutput]:
    inbox: asyncio.Queue = asyncio.Queue()
    out: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(executor.run(runner, inbox, out))
    for m in messages:
        inbox.put_nowait(m)
        await asyncio.sleep(random.random() * 0.003)
    got = [await asyncio.wait_for(out.get(), 5) for _ in range(expect)]
    inbox.put_nowait(None)
    await asyncio.wait_for(task, 5)
    assert out.empty()
    return got


def test_outputs_leave_in_step_order_even_when_an_earlier_wait_is_slow():
    runner = ScriptedRunner(slow={1, 4})
    got = asyncio.run(drive(runner, [batch(i) for i in range(1, 8)], 7))
    assert [o.step for o in got] == list(range(1, 8))
    assert [o.sampled[0].token_id for o in got] == list(range(1, 8))
    # step 2 was launched before step 1's slow wait ended: launching never waits for a collect
    order = runner.events
    assert order.index(("launch", 2)) < order.index(("collect", 1))


def test_deferred_masks_sample_after_the_mask_fill():
    runner = ScriptedRunner()
    msgs = [batch(1), batch(2, deferred=True), MaskFill(2, "mask-2"), batch(3, deferred=True), MaskFill(3, "mask-3")]
    got = asyncio.run(drive(runner, msgs, 3))
    assert [(o.step, o.sampled[0].token_id) for o in got] == [(1, 1), (2, 102), (3, 103)]
    ev = runner.events
    assert ev.index(("launch", 2)) < ev.index(("sample", 2)) < ev.index(("launch", 3))


def test_a_failing_step_reports_an_error_and_its_mask_fill_is_ignored():
    runner = ScriptedRunner(fail={2})
    msgs = [batch(1), batch(2, deferred=True), MaskFill(2, "mask-2"), batch(3)]
    got = asyncio.run(drive(runner, msgs, 3))
    assert [o.step for o in got] == [1, 2, 3]
    assert got[1].error is not None and "boom in step 2" in got[1].error
    assert got[0].error is None and got[2].error is None
    assert ("sample", 2) not in runner.events
