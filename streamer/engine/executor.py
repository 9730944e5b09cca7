"""Executor actor: owns the ModelRunner and runs one step at a time.

Inbox:  Batch, MaskFill (from the scheduler), None to stop.
Outbox: StepOutput -> scheduler inbox, in the order of the batches.
Invariants: the model runs only in this actor's single worker thread, so the
event loop keeps serving while a step computes; a failing step becomes a
StepOutput with `error` set (its requests fail, the engine lives on).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor

from streamer.messages import Batch, MaskFill, StepOutput
from streamer.model.runner import Launched, ModelRunner

log = logging.getLogger("streamer.executor")


async def run(runner: ModelRunner, inbox: asyncio.Queue, to_scheduler: asyncio.Queue) -> None:
    """Launch each batch as soon as it arrives; collect the previous one's tokens after
    that, so with two batches queued the device always has the next step to run."""
    loop = asyncio.get_running_loop()
    pending: Launched | StepOutput | None = None

    async def collect(item: Launched | StepOutput) -> None:
        if isinstance(item, Launched):
            try:
                item = await loop.run_in_executor(thread, runner.collect, item)
            except Exception as e:  # noqa: BLE001
                log.error("step %d failed:\n%s", item.step, traceback.format_exc())
                item = StepOutput(item.step, [], error=f"internal error in model step: {e}")
        to_scheduler.put_nowait(item)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step") as thread:
        while True:
            ready = not (isinstance(pending, Launched) and pending.awaiting_masks)
            if pending is not None and ready and inbox.empty():
                await collect(pending)
                pending = None
                continue
            msg: Batch | MaskFill | None = await inbox.get()
            if msg is None:
                if pending is not None and ready:
                    await collect(pending)
                return
            if isinstance(msg, MaskFill):
                # the forward of this step ran while the scheduler filled its masks
                if not (isinstance(pending, Launched) and pending.awaiting_masks and pending.step == msg.step):
                    continue  # that step failed already and its error has been sent
                try:
                    pending = await loop.run_in_executor(thread, runner.sample, pending, msg.masks)
                except Exception as e:  # noqa: BLE001
                    log.error("step %d failed:\n%s", msg.step, traceback.format_exc())
                    pending = StepOutput(msg.step, [], error=f"internal error in model step: {e}")
                continue
            assert ready, "a batch arrived before the masks of the one in flight"
            launched: Launched | StepOutput
            try:
                launched = await loop.run_in_executor(thread, runner.launch, msg)
            except Exception as e:  # noqa: BLE001 - reported to the requests of this step
                log.error("step %d failed:\n%s", msg.step, traceback.format_exc())
                launched = StepOutput(msg.step, [], error=f"internal error in model step: {e}")
            if pending is not None:
                await collect(pending)
            pending = launched
