"""Executor actor: owns the ModelRunner and runs one step at a time.

Inbox:  Batch (from the scheduler), None to stop.
Outbox: StepOutput -> scheduler inbox.
Invariants: the model runs only in this actor's single worker thread, so the
event loop keeps serving while a step computes; a failing step becomes a
StepOutput with `error` set (its requests fail, the engine lives on).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor

from streamer.messages import Batch, StepOutput
from streamer.model.runner import ModelRunner

log = logging.getLogger("streamer.executor")


async def run(runner: ModelRunner, inbox: asyncio.Queue, to_scheduler: asyncio.Queue) -> None:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step") as thread:
        while True:
            batch: Batch | None = await inbox.get()
            if batch is None:
                return
            try:
                out = await loop.run_in_executor(thread, runner.step, batch)
            except Exception as e:  # noqa: BLE001 - reported to the requests of this step
                log.error("step %d failed:\n%s", batch.step, traceback.format_exc())
                out = StepOutput(batch.step, [], error=f"internal error in model step: {e}")
            to_scheduler.put_nowait(out)
