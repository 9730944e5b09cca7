"""A request's deadline (SamplingParams.timeout) and the engine's own health.

A deadline ends a request wherever it is, queued or running, with finish_reason "timeout"
and what it generated so far; its pages come back. A step that does not end makes the
engine `stalled` (health 503), while deadlines still end the requests waiting on it; an
actor that crashes ends every open request with an ENGINE_DOWN error.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamer import LLM, SamplingParams
from streamer.engine import health
from streamer.engine.engine import AsyncEngine
from streamer.messages import ENGINE_DOWN, GenerateRequest

LONG = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)


def request(rid: str, params: SamplingParams, prompt: str = "Tell me a long story.") -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt=prompt, params=params)


def test_a_deadline_ends_a_running_and_a_queued_request_and_frees_their_pages(default_model):
    with LLM(str(default_model), max_num_seqs=1) as llm:  # one at a time: the second one queues
        t0 = time.monotonic()
        running, queued = llm.generate(
            ["Tell me a long story.", "Count to a thousand."],
            [SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True, timeout=1.5),
             SamplingParams(max_tokens=4, temperature=0, timeout=0.5)],
        )
        elapsed = time.monotonic() - t0
        assert running.finish_reason == "timeout" and 0 < running.completion_tokens < 4000
        assert running.text and "timed out" in (running.error or "") and "running" in running.error
        assert queued.finish_reason == "timeout" and queued.completion_tokens == 0 and "queued" in queued.error
        assert elapsed < 1.5 + 1.0, "ended at its deadline, not later"
        s = llm.wait_idle()
        llm.check()
        assert s.running == s.waiting == 0 and s.pages_used == s.pages_cached


def test_a_stuck_step_makes_the_engine_stalled_and_deadlines_still_end_requests(default_model, monkeypatch):
    monkeypatch.setattr(health, "STEP_STALL_S", 0.3)
    engine = AsyncEngine(model=str(default_model))
    release = threading.Event()
    launch = engine.runner.launch

    def stuck_launch(batch):
        release.wait(30)  # a device (or worker thread) that does not come back
        return launch(batch)

    async def main() -> None:
        await engine.start()
        assert engine.stalled is None
        engine.runner.launch = stuck_launch  # type: ignore[method-assign]
        try:
            t0 = time.monotonic()
            task = asyncio.create_task(engine.generate(request("stuck", LONG)))
            timed = asyncio.create_task(engine.generate(request("timed", SamplingParams(max_tokens=8, timeout=0.6))))
            await asyncio.sleep(0.5)
            assert engine.stalled is not None and "model step" in engine.stalled
            out = await asyncio.wait_for(timed, 5)
            assert out.finish_reason == "timeout" and time.monotonic() - t0 < 0.6 + 0.5
            engine.abort("stuck")
            release.set()
            assert (await asyncio.wait_for(task, 10)).finish_reason == "abort"
            engine.runner.launch = launch  # type: ignore[method-assign]
            ok = await engine.generate(request("after", SamplingParams(max_tokens=4, temperature=0)))
            assert ok.finish_reason in ("stop", "length") and engine.stalled is None
            engine.scheduler.check()
        finally:
            release.set()
            await engine.stop()

    asyncio.run(main())


def test_a_crashed_actor_ends_every_open_request_with_engine_down(default_model):
    engine = AsyncEngine(model=str(default_model))

    def crash(*args, **kwargs):
        raise RuntimeError("scheduler bug")

    async def main() -> None:
        await engine.start()
        try:
            outputs = engine.submit(request("open", LONG))
            first = await anext(outputs)
            assert not first.finished
            engine.scheduler.process = crash  # type: ignore[method-assign]
            rest = [out async for out in outputs]
            last = rest[-1]
            assert last.finished and last.finish_reason == "error" and last.error_code == ENGINE_DOWN
            assert "scheduler bug" in (last.error or "") and engine.dead
            with pytest.raises(RuntimeError, match="the engine is down"):
                await engine.generate(request("new", LONG))
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
