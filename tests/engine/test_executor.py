"""The executor actor against a scripted runner: outputs leave in step order whatever
order the waits end in; a batch with deferred masks samples only when its MaskFill
arrives (handed to the launch thread directly, whatever the event loop is doing); a step
that fails becomes an error output and the actor keeps going."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import torch

from streamer.engine import executor
from streamer.engine.step_thread import StepThread
from streamer.messages import Batch, MaskFill, SampledToken, Shutdown, StepOutput
from streamer.model.launched import Launched, RowValues


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
            return Launched(batch.step, None, None, RowValues(), batch=batch)  # awaiting its masks
        return Launched(batch.step, torch.tensor([batch.step]), None, RowValues())

    def sample(self, launched: Launched, masks) -> Launched:
        self._log("sample", launched.step)
        assert masks == f"mask-{launched.step}"
        return Launched(launched.step, torch.tensor([100 + launched.step]), None, RowValues())

    def collect(self, launched: Launched) -> StepOutput:
        if launched.step in self.slow:
            time.sleep(0.05)
        self._log("collect", launched.step)
        assert launched.tokens is not None
        return StepOutput(launched.step, [SampledToken(t) for t in launched.tokens.tolist()])


def batch(step: int, deferred: bool = False) -> Batch:
    return Batch(step, [], [], [], [], masks_deferred=deferred)


async def drive(runner: ScriptedRunner, messages: list, expect: int) -> list[StepOutput]:
    inbox = executor.Inbox()
    out: asyncio.Queue = asyncio.Queue()
    step = StepThread()
    task = asyncio.create_task(executor.run(runner, inbox, out, step))
    for m in messages:
        inbox.put_nowait(m)
        await asyncio.sleep(random.random() * 0.003)
    got = [await asyncio.wait_for(out.get(), 5) for _ in range(expect)]
    inbox.put_nowait(Shutdown())
    await asyncio.wait_for(task, 5)
    step.close()
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


def test_a_stale_mask_fill_is_skipped_by_the_next_waiting_step():
    """Step 2 fails at launch, its MaskFill still comes; deferred step 3 takes its own."""
    runner = ScriptedRunner(fail={2})
    msgs = [batch(2, deferred=True), MaskFill(2, "mask-2"), batch(3, deferred=True), MaskFill(3, "mask-3")]
    got = asyncio.run(drive(runner, msgs, 2))
    assert [(o.step, o.error is None) for o in got] == [(2, False), (3, True)]
    assert got[1].sampled[0].token_id == 103 and ("sample", 2) not in runner.events


async def launched_deferred(runner: ScriptedRunner):
    """The actor running, with deferred step 1 launched: (inbox, outbox, task)."""
    inbox = executor.Inbox()
    out: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(executor.run(runner, inbox, out, StepThread()))
    inbox.put_nowait(batch(1, deferred=True))
    while ("launch", 1) not in runner.events:
        await asyncio.sleep(0.001)
    return inbox, out, task


def test_the_mask_fill_reaches_the_launch_thread_while_the_event_loop_is_busy():
    """The scheduler fills the masks on the loop, then the loop stays busy (streaming, say):
    the sampling happens meanwhile, without a turn of the loop."""
    runner = ScriptedRunner()

    async def scenario() -> StepOutput:
        inbox, out, task = await launched_deferred(runner)
        inbox.put_nowait(MaskFill(1, "mask-1"))
        deadline = time.monotonic() + 2
        while ("sample", 1) not in runner.events and time.monotonic() < deadline:
            time.sleep(0.001)  # blocks the event loop
        assert ("sample", 1) in runner.events
        got = await asyncio.wait_for(out.get(), 5)
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(scenario()).sampled[0].token_id == 101


def test_stopping_while_a_step_waits_for_its_masks():
    """The waiting launch thread is released: the step ends with an error and the actor stops."""
    runner = ScriptedRunner()

    async def scenario() -> StepOutput:
        inbox, out, task = await launched_deferred(runner)
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(task, 5)
        return out.get_nowait()

    got = asyncio.run(scenario())
    assert got.step == 1 and got.error is not None and ("sample", 1) not in runner.events


def test_cancelling_the_actor_while_a_step_waits_for_its_masks():
    """The waiting launch thread is released, so the actor's thread pool shuts down."""
    runner = ScriptedRunner()

    async def scenario() -> None:
        _, _, task = await launched_deferred(runner)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the actor hung on its thread pool's shutdown"

    asyncio.run(scenario())
