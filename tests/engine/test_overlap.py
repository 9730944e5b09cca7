"""Overlap scheduling: batch N+1 is built while N runs, its decodes reading N's sampled
tokens on the device. Outputs must not change, whatever finishes or aborts meanwhile."""

from __future__ import annotations

import random

from streamer import LLM, SamplingParams


def test_overlapped_schedule_gives_identical_outputs(tiny_models):
    path = tiny_models["qwen3"]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randint(5, 120))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=rng.random() < 0.5)
              for _ in prompts]
    params[3] = SamplingParams(max_tokens=20, temperature=0.8, seed=5)  # sampled, seeded
    params[4] = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[prompts[0][0]])
    with LLM(str(path), overlap_schedule=False) as plain:
        want = [(o.token_ids, o.finish_reason) for o in plain.generate(prompts, params)]
    with LLM(str(path), overlap_schedule=True, num_pages=40, max_num_batched_tokens=64) as ov:
        assert ov.engine.overlap
        got = [(o.token_ids, o.finish_reason) for o in ov.generate(prompts, params)]
        ov.check()
        s = ov.stats()
        assert s.running == 0 and s.pages_used == s.pages_cached
        assert s.steps_ahead > 0, "batches were scheduled while another ran"
    assert got == want


def test_overlap_with_preemption_and_aborts_keeps_the_page_invariant(tiny_models):
    import asyncio

    from streamer.messages import GenerateRequest

    path = tiny_models["qwen2"]
    rng = random.Random(3)
    with LLM(str(path), overlap_schedule=True, num_pages=24, page_size=8, max_num_seqs=8) as llm:

        async def scenario():
            tasks = []
            for i in range(60):
                p = [rng.randrange(10, 40000) for _ in range(rng.randint(2, 60))]
                req = GenerateRequest(request_id=f"o{i}", prompt_token_ids=p,
                                      params=SamplingParams(max_tokens=rng.randint(1, 30), temperature=0,
                                                            ignore_eos=True))
                tasks.append(asyncio.ensure_future(llm.engine.generate(req)))
                if rng.random() < 0.4:
                    await asyncio.sleep(rng.random() * 0.01)
                    llm.engine.abort(f"o{rng.randrange(i + 1)}")
            return await asyncio.gather(*tasks)

        outs = llm.call(scenario())
        assert {o.finish_reason for o in outs} <= {"abort", "length"}
        for o in outs:
            if o.finish_reason == "length":
                assert o.completion_tokens == len(o.token_ids) > 0
        s = llm.wait_idle()
        llm.check()
        assert s.steps_ahead > 0 and s.preemptions > 0
        assert s.running == 0 and s.pages_used == s.pages_cached
