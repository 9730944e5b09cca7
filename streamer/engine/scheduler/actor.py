"""Scheduler actor: the loop around the policy (policy.Scheduler).

Inbox:  TokenizedRequest (new work, from the tokenizer), StepOutput and DraftsDrawn (from
        the executor), Abort (from callers), Finish (from the detokenizer: a stop string matched),
        LoraUpdate (from the engine: an adapter loaded or unloaded, passed on to the executor),
        Shutdown (the engine stops: every request still here ends with "abort").
Outbox: Batch, MaskFill -> executor; TokenBatch -> detokenizer.

Invariants:
  - at most one Batch is in flight, two with overlap scheduling (the second is
    built while the first runs; its tokens to come are PLACEHOLDERs); requests
    in a batch are retired only when its StepOutput is back (the GPU may still
    be writing their pages);
  - a batch scheduled ahead with grammar rows gets its MaskFill right after
    the StepOutput of the batch before it is processed, before anything else
    goes to the executor; one sent with masks_await_drafts gets it as soon as the
    executor reports the draft's proposals (DraftsDrawn);
  - everything queued in the inbox is handled before the next batch is built, so one
    step sees every arrival;
  - the loop wakes up for the earliest deadline even with no message (deadlines.py), and
    for the end of a hold (clock.py), which it alone drives.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from streamer.engine.scheduler.policy import Scheduler
from streamer.messages import (
    Abort,
    Batch,
    DraftsDrawn,
    Finish,
    LoraUpdate,
    Shutdown,
    StepOutput,
    ToDetokenizer,
    ToExecutor,
    TokenBatch,
    TokenDelta,
    TokenizedRequest,
    ToScheduler,
)

_HOLD_OVER = object()
"""The scheduler's wake-up when a held batch is due."""
_DEADLINE = object()
"""The scheduler's wake-up when a request's deadline is due."""


async def run(
    sched: Scheduler,
    inbox: asyncio.Queue[ToScheduler],
    to_executor: asyncio.Queue[ToExecutor],
    to_detokenizer: asyncio.Queue[ToDetokenizer],
    overlap: bool = False,
) -> None:
    """The actor loop: handle every message; keep a step in flight while there is work.

    With overlap, a second batch is scheduled while the first runs (its decodes read the
    tokens the first one samples on the device), so the GPU never waits for the host;
    while only decodes run, not at once but shortly before the first ends (AheadClock).
    """
    loop = asyncio.get_running_loop()
    jump_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-jump")
    try:
        await _loop(sched, inbox, to_executor, to_detokenizer, overlap, loop, jump_thread)
    finally:
        jump_thread.shutdown(wait=False)


async def _loop(
    sched: Scheduler,
    inbox: asyncio.Queue[ToScheduler],
    to_executor: asyncio.Queue[ToExecutor],
    to_detokenizer: asyncio.Queue[ToDetokenizer],
    overlap: bool,
    loop: asyncio.AbstractEventLoop,
    jump_thread: ThreadPoolExecutor,
) -> None:
    in_flight: deque[Batch] = deque()
    depth = 2 if overlap else 1
    clock = sched.clock
    hold: float | None = None
    holding = False  # the batch after in_flight[0] has been held at least once
    while True:
        msg: ToScheduler | object
        deadline = sched.next_deadline()
        wake = hold if deadline is None else deadline if hold is None else min(hold, deadline)
        if wake is None:
            msg = await inbox.get()
        else:
            try:  # (time.monotonic, not loop.time: uvloop's clock moves in whole milliseconds)
                async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                    msg = await inbox.get()
            except TimeoutError:
                msg = _HOLD_OVER if hold is not None and time.monotonic() >= hold else _DEADLINE
        hold_over = msg is _HOLD_OVER
        hold = None
        deltas: list[TokenDelta] = sched.expire(time.monotonic()) if deadline is not None else []
        while not hold_over and msg is not _DEADLINE:  # drain what is queued: one step sees every arrival
            if isinstance(msg, TokenizedRequest):
                refused = sched.add(msg)
                if refused is not None:
                    deltas.append(refused)
            elif isinstance(msg, StepOutput):
                done = in_flight.popleft()
                assert msg.step == done.step, "step outputs arrive in order"
                clock.on_output(done, msg, time.monotonic())
                deltas.extend(sched.process(done, msg))
                if sched.jumps:
                    forced = await loop.run_in_executor(jump_thread, sched.compute_jumps)
                    deltas.extend(sched.apply_jumps(forced))
                if in_flight and in_flight[0].masks_deferred and not in_flight[0].masks_await_drafts:
                    # the next step's forward is running: its masks are filled now, on the CPU,
                    # and go straight to the executor's launch thread (executor.Inbox)
                    to_executor.put_nowait(sched.fill_deferred(in_flight[0].step))
            elif isinstance(msg, DraftsDrawn):
                # a step of in_flight awaits the masks of its draft's proposals (its forward runs)
                to_executor.put_nowait(sched.fill_drafted(msg.step, msg.drafts))
            elif isinstance(msg, Abort | Finish):
                d = sched.finish(msg.request_id, msg.reason)
                if d is not None:
                    deltas.append(d)
            elif isinstance(msg, LoraUpdate):
                # (an adapter going away: its requests end now, before the executor drops it; the
                # batches in flight that hold them were sent before this, and run first)
                deltas.extend(sched.update_lora(msg.key, msg.adapter is not None))
                to_executor.put_nowait(msg)
            elif isinstance(msg, Shutdown):
                deltas.extend(sched.abort_all())
                if deltas:
                    to_detokenizer.put_nowait(TokenBatch(deltas))
                return
            if inbox.empty():
                break
            msg = inbox.get_nowait()
        if deltas:
            to_detokenizer.put_nowait(TokenBatch(deltas))
        while len(in_flight) < depth and sched.has_work:
            if in_flight and not sched.can_overlap():
                break
            if in_flight and not hold_over:
                hold = clock.hold_until(in_flight[0], sched)
                if hold is not None and hold > time.monotonic():
                    holding = True
                    break
                hold = None
            admitted = len(sched.waiting)
            batch = sched.schedule(ahead=bool(in_flight))
            if batch is None:
                holding = False
                break
            if holding:
                clock.joined += len(sched.waiting) < admitted
            in_flight.append(batch)
            clock.on_send(batch, time.monotonic(), held=holding)
            holding = False
            to_executor.put_nowait(batch)
