"""Executor actor: owns the ModelRunner; launches steps and collects their tokens.

Inbox:  Batch, MaskFill, LoraUpdate (from the scheduler), Shutdown (the engine stops); an `Inbox`,
        which hands a MaskFill straight to the launch thread instead of queueing it for
        the loop (and, at Shutdown, releases a step still waiting there for its masks).
Outbox: StepOutput -> scheduler inbox, in the order of the batches; DraftsDrawn (a batch
        sent with masks_await_drafts: the draft's proposals, right after its forward).
Invariants:
  - the model runs only in the engine's StepThread (engine/step_thread.py: on the CPU it
    was built there too), so the event loop keeps serving while a step computes;
  - a batch is launched as soon as it arrives, while earlier steps are still
    running; a second thread waits for each launched step's tokens, so waiting
    never holds up the next launch (the device always has queued work when the
    scheduler keeps up);
  - a batch sent with masks_deferred runs its forward at once; then the launch
    thread waits for its MaskFill (which the scheduler sends before any later
    batch; with masks_await_drafts, once it has the DraftsDrawn sent here) and samples the moment it arrives: no hop through the event loop,
    which may be busy (streaming, detokenizing) while the device waits;
  - a failing step becomes a StepOutput with `error` set (its requests fail,
    the engine lives on);
  - a LoraUpdate changes the layers after the batches before it were launched and before
    any after it (the launch thread's order); its `done` gets the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import traceback
from concurrent.futures import ThreadPoolExecutor

from streamer.engine.step_thread import StepThread
from streamer.messages import (
    Batch,
    DraftsDrawn,
    LoraUpdate,
    MaskFill,
    Shutdown,
    StepOutput,
    ToExecutor,
    ToScheduler,
)
from streamer.model.launched import Launched
from streamer.model.runner import ModelRunner

log = logging.getLogger("streamer.executor")


def _failed(step: int, e: BaseException) -> StepOutput:
    log.error("step %d failed:\n%s", step, "".join(traceback.format_exception(e)))
    return StepOutput(step, [], error=f"internal error in model step: {e}")


class Inbox(asyncio.Queue[ToExecutor]):
    """The executor's inbox: an asyncio queue, except that a MaskFill goes to a thread-safe
    queue that the launch thread reads while a step waits for its masks."""

    def __init__(self) -> None:
        super().__init__()
        self.fills: queue.SimpleQueue[MaskFill | Shutdown] = queue.SimpleQueue()

    def put_nowait(self, item: ToExecutor) -> None:
        if isinstance(item, MaskFill):
            self.fills.put(item)
        else:
            super().put_nowait(item)


async def run(runner: ModelRunner, inbox: Inbox, to_scheduler: asyncio.Queue[ToScheduler], step: StepThread) -> None:
    """step: the thread that runs the model (it outlives this actor: the engine may start again)."""
    loop = asyncio.get_running_loop()
    thread = step.pool
    last: asyncio.Task | None = None  # the newest collection: outputs leave in step order

    waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-wait")

    def collect(step: int, item: Launched | StepOutput | asyncio.Future) -> None:
        nonlocal last
        prev = last

        async def deliver() -> None:
            out: StepOutput
            got = item
            try:
                if isinstance(got, asyncio.Future):
                    got = await got  # sampled on the launch thread once its masks came
                if isinstance(got, StepOutput):
                    out = got
                else:
                    out = await loop.run_in_executor(waiter, runner.collect, got)
            except Exception as e:  # noqa: BLE001
                out = _failed(step, e)
            if prev is not None:
                await prev
            to_scheduler.put_nowait(out)

        last = asyncio.create_task(deliver())

    def sample_when_masked(pending: Launched) -> Launched | StepOutput:
        """On the launch thread, right after the forward of `pending`: wait for its MaskFill
        and sample. Later batches queue behind this in the thread, so they launch after it."""
        while True:
            fill = inbox.fills.get()
            if isinstance(fill, Shutdown):
                return StepOutput(pending.step, [], error="the engine stopped before this step's grammar masks")
            if fill.step == pending.step:
                return runner.sample(pending, fill.masks)
            # an earlier step's fill: that step failed at launch and its error has been sent

    with waiter:
        try:
            while True:
                msg = await inbox.get()
                if isinstance(msg, Shutdown):
                    inbox.fills.put(msg)  # (a step still waiting for masks gives up)
                    if last is not None:
                        await last
                    return
                if isinstance(msg, LoraUpdate):  # (between steps: the launch thread runs one thing at a time)
                    try:
                        await loop.run_in_executor(thread, runner.update_lora, msg)
                    except Exception as e:  # noqa: BLE001 - the engine's caller gets it; nothing changed
                        if not msg.done.done():
                            msg.done.set_exception(e)
                    else:
                        if not msg.done.done():
                            msg.done.set_result(None)
                    continue
                assert isinstance(msg, Batch)  # (a MaskFill goes to `fills`, never here)
                item: Launched | StepOutput
                try:
                    item = await loop.run_in_executor(thread, runner.launch, msg)
                except Exception as e:  # noqa: BLE001 - reported to the requests of this step
                    item = _failed(msg.step, e)
                if isinstance(item, Launched) and item.awaiting_masks:
                    if msg.masks_await_drafts and item.proposed is not None:
                        to_scheduler.put_nowait(DraftsDrawn(msg.step, item.proposed.drafts))
                    collect(msg.step, loop.run_in_executor(thread, sample_when_masked, item))
                else:
                    collect(msg.step, item)
        except BaseException:
            # cancelled (or failed) with a step waiting for masks: release the launch thread,
            # or the pool's shutdown on the way out would wait for it forever
            inbox.fills.put(Shutdown())
            raise
