"""Executor actor: owns the ModelRunner; launches steps and collects their tokens.

Inbox:  Batch, MaskFill (from the scheduler), None to stop.
Outbox: StepOutput -> scheduler inbox, in the order of the batches.
Invariants:
  - the model runs only in the "launch" worker thread, so the event loop keeps
    serving while a step computes;
  - a batch is launched as soon as it arrives, while earlier steps are still
    running; a second thread waits for each launched step's tokens, so waiting
    never holds up the next launch (the device always has queued work when the
    scheduler keeps up);
  - a batch sent with masks_deferred runs its forward at once and samples when
    its MaskFill arrives (which the scheduler sends before any later batch);
  - a failing step becomes a StepOutput with `error` set (its requests fail,
    the engine lives on).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor

from streamer.messages import Batch, MaskFill, StepOutput
from streamer.model.runner import Launched, ModelRunner

log = logging.getLogger("streamer.executor")


def _failed(step: int, e: BaseException) -> StepOutput:
    log.error("step %d failed:\n%s", step, "".join(traceback.format_exception(e)))
    return StepOutput(step, [], error=f"internal error in model step: {e}")


async def run(runner: ModelRunner, inbox: asyncio.Queue, to_scheduler: asyncio.Queue) -> None:
    loop = asyncio.get_running_loop()
    awaiting: Launched | None = None  # forward done, waiting for its MaskFill
    last: asyncio.Task | None = None  # the newest collection: outputs leave in step order

    waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-wait")

    def collect(item: Launched | StepOutput) -> None:
        nonlocal last
        prev = last

        async def deliver() -> None:
            out: StepOutput
            if isinstance(item, StepOutput):
                out = item
            else:
                try:
                    out = await loop.run_in_executor(waiter, runner.collect, item)
                except Exception as e:  # noqa: BLE001
                    out = _failed(item.step, e)
            if prev is not None:
                await prev
            to_scheduler.put_nowait(out)

        last = asyncio.create_task(deliver())

    with waiter, ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step") as thread:
        while True:
            msg: Batch | MaskFill | None = await inbox.get()
            if msg is None:
                if last is not None:
                    await last
                return
            item: Launched | StepOutput
            if isinstance(msg, MaskFill):
                # the forward of this step ran while the scheduler filled its masks
                if awaiting is None or awaiting.step != msg.step:
                    continue  # that step failed already and its error has been sent
                pending, awaiting = awaiting, None
                try:
                    item = await loop.run_in_executor(thread, runner.sample, pending, msg.masks)
                except Exception as e:  # noqa: BLE001
                    item = _failed(msg.step, e)
                collect(item)
                continue
            assert awaiting is None, "a batch arrived before the masks of the one in flight"
            try:
                item = await loop.run_in_executor(thread, runner.launch, msg)
            except Exception as e:  # noqa: BLE001 - reported to the requests of this step
                item = _failed(msg.step, e)
            if isinstance(item, Launched) and item.awaiting_masks:
                awaiting = item
            else:
                collect(item)
