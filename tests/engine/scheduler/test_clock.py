"""Holding the batch scheduled ahead: while only decodes run, the batch after the running
one is scheduled shortly before the running step is predicted to end, so that a request
arriving meanwhile joins it instead of queueing behind it (EngineConfig.hold_ahead_ms).

The scheduler actor runs against a fake device that executes each batch for a fixed time,
in order, the way a CUDA stream does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamer.config import EngineConfig
from streamer.engine import scheduler as sched_mod
from streamer.engine.scheduler import Scheduler
from streamer.kv.pages import PagePool
from streamer.messages import Batch, SampledToken, SamplingParams, StepOutput, TokenizedRequest

STEP = 0.1
"""Device time of every fake step, in seconds."""


def request(rid: str, max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7], eos_token_ids=[2],
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


async def scenario(hold_ms: float) -> tuple[int, int, Scheduler]:
    """A request decodes; a second arrives 30 ms into one of its steps. Returns (the step
    running when it arrived, the step that first computes it, the scheduler)."""
    pool = PagePool(1, 64, 16, 1, 4, torch.float32, "cpu")
    sched = Scheduler(EngineConfig(num_pages=64, hold_ahead_ms=hold_ms), pool, max_model_len=4096)
    inbox: asyncio.Queue = asyncio.Queue()
    to_exec: asyncio.Queue = asyncio.Queue()
    to_detok: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    started: dict[int, float] = {}
    first_step: dict[str, int] = {}

    async def device() -> None:
        free_at = loop.time()
        while True:
            batch: Batch = await to_exec.get()
            for s in batch.seqs:
                first_step.setdefault(s.request_id, batch.step)
            start = max(loop.time(), free_at)
            idle = start - free_at if started else 0.0
            started[batch.step] = start
            free_at = start + STEP
            n = sum(s.sample for s in batch.seqs)

            async def finish(step: int = batch.step, at: float = free_at, n: int = n, idle: float = idle) -> None:
                await asyncio.sleep(at - loop.time())
                inbox.put_nowait(StepOutput(step, [SampledToken(9)] * n, device_time=STEP, idle_before=idle))

            loop.create_task(finish())

    actor = loop.create_task(sched_mod.run(sched, inbox, to_exec, to_detok, overlap=True))
    dev = loop.create_task(device())
    inbox.put_nowait(request("a", 40))
    while len(started) < 6:  # a few decode steps: the clock learns their duration
        await asyncio.sleep(0.005)
    running = max(started)
    await asyncio.sleep(started[running] + 0.03 - loop.time())
    arrived = max(s for s, t in started.items() if t <= loop.time())
    inbox.put_nowait(request("b", 2))
    while "b" not in first_step:
        await asyncio.sleep(0.005)
    actor.cancel()
    dev.cancel()
    return arrived, first_step["b"], sched


@pytest.mark.parametrize("hold_ms", [40.0, 0.0])
def test_a_request_arriving_mid_step_joins_the_very_next_batch_when_holding(hold_ms):
    arrived, first, sched = asyncio.run(scenario(hold_ms))
    stats = sched.stats()
    if hold_ms:
        assert first == arrived + 1, "it joined the batch after the running one"
        assert stats.steps_held >= 4 and stats.held_steps_joined == 1
        assert stats.held_steps_late == 0, "held batches were still sent before the running step ended"
        assert sched.clock.decode_s == pytest.approx(STEP)
    else:
        assert first == arrived + 2, "without holding, the batch after the running one was already queued"
        assert stats.steps_held == 0


def test_no_hold_while_requests_wait_or_prefills_run():
    clock = sched_mod.AheadClock(0.001)
    pool = PagePool(1, 64, 16, 1, 4, torch.float32, "cpu")
    sched = Scheduler(EngineConfig(num_pages=64), pool, max_model_len=4096)
    sched.add(request("a", 5))
    prefill = sched.schedule()
    assert clock.hold_until(prefill, sched) is None, "no estimate yet"
    clock.on_output(prefill, StepOutput(prefill.step, [SampledToken(9)], device_time=0.05), 1.0)
    assert clock.decode_s is None, "a prefill step says nothing about decode steps"
    sched.process(prefill, StepOutput(prefill.step, [SampledToken(9)]))
    decode = sched.schedule()
    clock.on_send(decode, 1.0)
    clock.on_output(decode, StepOutput(decode.step, [SampledToken(9)], device_time=0.01), 1.01)
    assert clock.decode_s == 0.01
    assert clock.hold_until(decode, sched) == pytest.approx(1.01 + 0.01 - 0.001)
    sched.add(request("b", 5))
    assert clock.hold_until(decode, sched) is None, "someone waits: schedule at once"
    assert clock.hold_until(prefill, sched) is None
    assert sched_mod.AheadClock(0.0).hold_until(decode, sched) is None, "hold_ahead_ms=0 turns it off"


def test_the_margin_grows_when_a_held_batch_reaches_the_device_late():
    pool = PagePool(1, 64, 16, 1, 4, torch.float32, "cpu")
    sched = Scheduler(EngineConfig(num_pages=64, max_num_seqs=2), pool, max_model_len=4096)
    clock = sched.clock
    sched.add(request("a", 50))
    b = sched.schedule()
    sched.process(b, StepOutput(b.step, [SampledToken(9)]))
    d1 = sched.schedule()
    clock.on_send(d1, 0.0)
    clock.on_output(d1, StepOutput(d1.step, [SampledToken(9)], device_time=0.02), 0.02)
    sched.process(d1, StepOutput(d1.step, [SampledToken(9)]))
    d2 = sched.schedule()
    clock.on_send(d2, 0.02)
    before = clock.hold_until(d2, sched)
    assert before == pytest.approx(0.02 + 0.02 - clock.margin)
    d3 = sched.schedule(ahead=True)
    clock.on_send(d3, before, held=True)
    clock.on_output(d2, StepOutput(d2.step, [SampledToken(9)], device_time=0.02), 0.04)
    clock.on_output(d3, StepOutput(d3.step, [SampledToken(9)], device_time=0.02, idle_before=0.003), 0.063)
    assert clock.held == 1 and clock.late == 1
    assert clock.extra == pytest.approx(0.0032 * 0.98), "late by 3 ms: held 3.2 ms earlier (decaying per step)"
    d4 = sched.schedule()
    clock.on_send(d4, 0.063)
    assert clock.hold_until(d4, sched) == pytest.approx(0.063 + 0.02 - clock.margin - clock.extra), "held earlier now"
    saved = clock.extra
    clock.extra = 0.015  # a slow patch (the warm-up's compiles): holding is not worth it
    assert clock.hold_until(d4, sched) is None
    for _ in range(150):
        clock.on_output(d4, StepOutput(d4.step, [SampledToken(9)], device_time=0.02), 0.07)
    assert clock.hold_until(d4, sched) is not None, "forgotten after ~100 decode steps"
    clock.extra = saved
    sched.add(request("b", 5))
    sched.process(d4, StepOutput(d4.step, [SampledToken(9)]))
    both = sched.schedule()
    assert len(both.seqs) == 2 and not sched.waiting
    sched.process(both, StepOutput(both.step, [SampledToken(9)] * 2))
    decodes = sched.schedule()
    assert [len(c.token_ids) for c in decodes.seqs] == [1, 1]
    assert clock.hold_until(decodes, sched) is None, "at max_num_seqs (2) nobody could join: no hold"
