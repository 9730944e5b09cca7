"""While an engine runs, Python's cyclic collector runs rarely: each full collection walks
every live request's token lists with all threads stopped (~25 ms at W3's 512 requests of
2,000 tokens), and at the default threshold one came every ~22 decode steps."""

from __future__ import annotations

import asyncio
import gc

from streamer.engine.engine import GC_GEN0_THRESHOLD, AsyncEngine


def test_the_collector_threshold_is_raised_while_engines_run_and_restored_after(tiny_models):
    before = gc.get_threshold()
    first = AsyncEngine(model=str(tiny_models["qwen2"]), device="cpu")
    second = AsyncEngine(model=str(tiny_models["qwen2"]), device="cpu")

    async def main() -> None:
        await first.start()
        await second.start()
        assert gc.get_threshold()[0] >= GC_GEN0_THRESHOLD
        await first.stop()
        assert gc.get_threshold()[0] >= GC_GEN0_THRESHOLD, "the other engine still runs"
        await second.stop()
        await second.stop()  # (a second stop changes nothing)

    asyncio.run(main())
    assert gc.get_threshold() == before
