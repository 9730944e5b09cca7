"""AsyncEngine: continuous batching against one paged + radix KV pool.

Every scenario ends with the page invariant: each page is free, held by the
radix tree, or held by a running request, and the refcounts say so.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest

from streamer import LLM, SamplingParams
from streamer.messages import GenerateRequest
from tests.oracle import Comparison, compare

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def text_ids(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based inks and a wooden press. Books became cheaper, literacy "
        "spread, and ideas travelled faster than ever before across Europe and the rest of the world. "
    ) * 20
    return tok(text)["input_ids"]


@pytest.fixture(scope="module")
def plain_llm(default_model):
    """An engine of the default configuration, shared by the tests that need no fresh one
    (what they read of it is greedy outputs, which no earlier request changes)."""
    with LLM(str(default_model)) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny(tiny_models):
    """A tiny random Llama-3 with the default model's tokenizer: for the scenarios about pages
    and the pool, where what the model writes does not matter but each step's time does (the
    default model's steps are ~20x longer on CPU)."""
    return tiny_models["llama3"]


def distinct_prompts(ids, n, lo, hi, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def settle(llm: LLM) -> None:
    s = llm.wait_idle()
    llm.check()
    assert s.running == 0 and s.waiting == 0
    assert s.pages_used == s.pages_cached, "every page is free or held by the cache"


def run(llm: LLM, coro):
    return llm.call(coro)


def test_staggered_arrivals_match_transformers(default_model, text_ids):
    prompts = distinct_prompts(text_ids, 6, 10, 120, seed=1)
    with LLM(str(default_model), max_num_batched_tokens=64) as llm:

        async def scenario():
            async def one(i, p):
                await asyncio.sleep(0.15 * i)  # arrive while the earlier ones decode
                req = GenerateRequest(request_id=f"s{i}", prompt_token_ids=p, params=GREEDY)
                return await llm.engine.generate(req)

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        outs = run(llm, scenario())
        cmp = Comparison()
        for p, o in zip(prompts, outs):
            compare(default_model, p, o.token_ids, cmp)
        assert not cmp.failures, cmp.failures
        assert llm.stats().max_batch_size > 1, "arrivals joined a running batch"
        settle(llm)


def test_shared_prefix_is_served_from_the_cache(default_model, text_ids):
    prefix = text_ids[:200]
    a, b = prefix + text_ids[300:310], prefix + text_ids[400:415]
    with LLM(str(default_model)) as llm:
        first = llm.generate([a], GREEDY)[0]
        second = llm.generate([b], GREEDY)[0]
        assert first.cached_tokens == 0
        assert second.cached_tokens >= 192
        settle(llm)
    with LLM(str(default_model), enable_prefix_caching=False) as cold:
        assert cold.generate([b], GREEDY)[0].token_ids == second.token_ids


def test_heavy_eviction_stays_correct(tiny, text_ids):
    prompts = distinct_prompts(text_ids, 10, 60, 150, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(tiny), num_pages=40, max_num_seqs=4) as llm:  # 39 pages of 16 tokens
        outs = []
        for i in range(0, 10, 2):  # re-send half of the earlier prompts: hits mixed with evictions
            outs += llm.generate(prompts[i : i + 2] + prompts[max(0, i - 2) : i], params)
        settle(llm)
    cmp = Comparison()
    sent = [p for i in range(0, 10, 2) for p in prompts[i : i + 2] + prompts[max(0, i - 2) : i]]
    for p, o in zip(sent, outs):
        compare(tiny, p, o.token_ids, cmp)
    assert not cmp.failures, cmp.failures


def test_preemption_when_pages_run_out_keeps_outputs_identical(tiny, text_ids):
    prompts = distinct_prompts(text_ids, 6, 80, 120, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(tiny)) as roomy:
        expected = [o.token_ids for o in roomy.generate(prompts, params)]
    with LLM(str(tiny), num_pages=30) as tight:  # 6 x ~8 pages do not fit in 29
        got = [o.token_ids for o in tight.generate(prompts, params)]
        assert tight.stats().preemptions > 0
        settle(tight)
    assert got == expected


def test_request_that_can_never_fit_is_refused_at_once(default_model):
    with LLM(str(default_model), num_pages=10) as llm:
        t = time.monotonic()
        out = llm.generate(["hello"], SamplingParams(max_tokens=500))[0]
        assert out.finish_reason == "error" and "KV pages" in out.error
        assert time.monotonic() - t < 5
        ok = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))[0]
        assert ok.error is None and ok.completion_tokens == 4


def test_prompt_over_the_context_length_is_a_clear_error(default_model):
    with LLM(str(default_model), max_model_len=64) as llm:
        out = llm.generate([list(range(100, 160))], SamplingParams(max_tokens=10))[0]
        assert out.finish_reason == "error" and "maximum context length is 64" in out.error


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(plain_llm, text_ids):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cut = plain_llm.generate([text_ids[:300]], msgspec.structs.replace(greedy, truncate_prompt_tokens=40))[0]
    last = plain_llm.generate([text_ids[260:300]], greedy)[0]
    assert cut.token_ids == last.token_ids and cut.prompt_tokens == 40
    chat = [{"role": "user", "content": "Say something about printing presses, please."}]
    # (a chat prompt is cut after its template: the last tokens are the generation prompt's)
    out = plain_llm.chat(chat, msgspec.structs.replace(greedy, truncate_prompt_tokens=6))
    assert out.prompt_tokens == 6 and out.error is None
    bad = plain_llm.generate([text_ids[:10]], msgspec.structs.replace(greedy, truncate_prompt_tokens=0))[0]
    assert bad.finish_reason == "error" and "truncate_prompt_tokens" in bad.error


def test_fill_context_is_the_room_the_prompt_leaves_in_the_context_or_the_pool(tiny):
    """SamplingParams.fill_context (a chat without max_tokens): the tokenizer actor, which
    knows the prompt's length, makes max_tokens the room left, and the scheduler's KV check
    sees that number; a prompt that leaves no room is refused with the context-length error."""
    from streamer.messages import CONTEXT_LENGTH_EXCEEDED

    fill = SamplingParams(fill_context=True, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": "Hi"}]
    with LLM(str(tiny), max_model_len=64) as llm:
        out = llm.chat(messages, fill)
        assert out.error is None and out.finish_reason == "length"
        assert out.completion_tokens == 64 - out.prompt_tokens > 0
        full = llm.generate([list(range(100, 164))], fill)[0]
        assert full.finish_reason == "error" and full.error_code == CONTEXT_LENGTH_EXCEEDED
        assert full.error == "this model's maximum context length is 64 tokens; the prompt has 64 tokens"
    with LLM(str(tiny), num_pages=10) as llm:  # a pool smaller than the context
        pool = llm.engine.runner.pool
        out = llm.chat(messages, fill)
        assert out.error is None and out.completion_tokens == pool.capacity * pool.page_size - out.prompt_tokens
        settle(llm)


@pytest.fixture(scope="module")
def shared_llm(default_model):
    with LLM(str(default_model), max_num_seqs=2, max_num_batched_tokens=32) as llm:
        yield llm


async def _abort_when(llm: LLM, rid: str, prompt, predicate):
    """Submit, abort as soon as predicate(scheduler request) holds, return the last output."""
    engine = llm.engine
    req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=200, ignore_eos=True))
    task = asyncio.ensure_future(engine.generate(req))
    for _ in range(2000):
        r = engine.scheduler.requests.get(rid)
        if r is not None and predicate(r):
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError(f"{rid} never reached the stage")
    engine.abort(rid)
    return await task


@pytest.mark.parametrize(
    "stage,predicate",
    [
        ("waiting", lambda r: r.status == 0),
        ("prefilling", lambda r: r.status == 1 and 0 < r.num_computed < r.prompt_len),
        ("decoding", lambda r: r.num_output >= 3),
    ],
)
def test_abort_at_every_stage_frees_pages(shared_llm, text_ids, stage, predicate):
    llm = shared_llm
    blockers = []

    async def scenario():
        if stage == "waiting":  # two running requests fill max_num_seqs, the third waits
            for i in range(2):
                req = GenerateRequest(request_id=f"b{stage}{i}", prompt_token_ids=text_ids[i * 10 : i * 10 + 20],
                                      params=SamplingParams(max_tokens=30, ignore_eos=True))
                blockers.append(asyncio.ensure_future(llm.engine.generate(req)))
            await asyncio.sleep(0.05)
        out = await _abort_when(llm, f"a-{stage}", text_ids[:150], predicate)
        await asyncio.gather(*blockers)
        return out

    out = run(llm, scenario())
    assert out.finish_reason == "abort"
    settle(llm)


def test_random_submits_and_aborts_leave_no_page_behind(shared_llm, text_ids):
    llm = shared_llm
    rng = random.Random(7)

    async def scenario():
        tasks = []
        for i in range(100):
            p = distinct_prompts(text_ids, 1, 2, 40, seed=i)[0]
            req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                                  params=SamplingParams(max_tokens=rng.randint(1, 6), temperature=1.0))
            tasks.append(asyncio.ensure_future(llm.engine.generate(req)))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() * 0.02)
                llm.engine.abort(f"r{rng.randrange(i + 1)}")
        return await asyncio.gather(*tasks)

    outs = run(llm, scenario())
    assert {o.finish_reason for o in outs} <= {"abort", "length", "stop"}
    assert any(o.finish_reason == "abort" for o in outs)
    settle(llm)


def test_event_loop_is_never_blocked_for_50ms(default_model, text_ids):
    """The engine's work happens off the event loop: between two ticks of a 5 ms ticker the
    loop's own thread never computes for 50 ms (CPU time of that thread, so that a loaded
    machine's preemption or the GIL held by the step thread do not count), and wall-clock
    gaps stay short too (a lock or a blocking call on the loop would show there)."""
    prompts = distinct_prompts(text_ids, 8, 50, 300, seed=8)
    with LLM(str(default_model)) as llm:

        async def scenario():
            gaps, cpu = [], []
            done = False

            async def ticker():
                last, last_cpu = time.perf_counter(), time.thread_time()
                while not done:
                    await asyncio.sleep(0.005)
                    now, now_cpu = time.perf_counter(), time.thread_time()
                    gaps.append(now - last)
                    cpu.append(now_cpu - last_cpu)
                    last, last_cpu = now, now_cpu

            t = asyncio.ensure_future(ticker())
            reqs = [GenerateRequest(request_id=f"t{i}", prompt_token_ids=p, params=GREEDY) for i, p in enumerate(prompts)]
            await asyncio.gather(*(llm.engine.generate(r) for r in reqs))
            done = True
            await t
            return gaps, cpu

        gaps, cpu = run(llm, scenario())
    assert max(cpu) < 0.05, f"the event loop computed for {max(cpu) * 1e3:.1f} ms at once"
    gaps.sort()
    typical = gaps[int(0.99 * (len(gaps) - 1))] - 0.005
    assert typical < 0.05 and gaps[-1] < 0.5, f"event loop gaps: 99th percentile {typical * 1e3:.1f} ms, worst {gaps[-1] * 1e3:.1f} ms"


def test_kv_memory_holds_live_tokens(tiny, text_ids):
    prompts = distinct_prompts(text_ids, 8, 100, 300, seed=9)
    rng = random.Random(0)
    params = [SamplingParams(max_tokens=rng.randint(16, 40), temperature=0, ignore_eos=True) for _ in prompts]
    with LLM(str(tiny)) as llm:
        llm.generate(prompts, params)
        eff = llm.stats().kv_efficiency
    print(f"KV efficiency {eff:.3f}")
    assert eff >= 0.95


def test_stop_string_spanning_tokens_ends_the_request_without_leaking(plain_llm):
    llm = plain_llm
    free = llm.generate(["The capital of France is a city that"], GREEDY)[0]
    text = free.text  # " has been a beacon of innovation and creativity ..."
    stop = "beacon of inno"
    assert stop in text
    out = llm.generate(["The capital of France is a city that"],
                       SamplingParams(max_tokens=24, temperature=0, stop=["never written", stop]))[0]
    assert out.finish_reason == "stop" and out.stop == stop  # (which stop string it was)
    assert out.text == text[: text.index(stop)]
    assert out.completion_tokens < free.completion_tokens
    assert free.stop is None
    settle(llm)


def test_requests_arriving_together_compute_a_shared_prefix_once(default_model, text_ids):
    prefix = text_ids[:200]
    prompts = [prefix + text_ids[300 + 7 * i : 310 + 7 * i] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(default_model)) as llm:
        outs = llm.generate(prompts, params)  # all six wait in the queue at once
        cached = sorted(o.cached_tokens for o in outs)
        assert cached[0] == 0 and all(c >= 192 for c in cached[1:]), cached
        settle(llm)


def test_a_slow_consumer_gets_piled_up_tokens_as_one_increment(shared_llm, text_ids):
    """Outputs that queued while the caller was busy arrive merged; nothing is lost or
    reordered, and the final increment carries the totals."""
    llm = shared_llm
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    want = llm.generate([text_ids[:40]], params)[0]

    async def slow() -> list:
        req = GenerateRequest(request_id="slow-consumer", prompt_token_ids=text_ids[:40], params=params)
        outs = []
        async for out in llm.engine.submit(req):
            outs.append(out)
            await asyncio.sleep(0.15)  # meanwhile the engine produces several tokens
        return outs

    outs = run(llm, slow())
    assert len(outs) < 24, "some increments were merged"
    assert [t for o in outs for t in o.token_ids] == want.token_ids
    assert "".join(o.text for o in outs) == want.text
    assert [lp.token_id for o in outs for lp in o.logprobs] == want.token_ids
    assert outs[-1].finished and outs[-1].completion_tokens == 24
    assert not any(o.finished for o in outs[:-1])
    settle(llm)


POISON = 7777  # a token id that makes any step holding it fail: a stand-in for an input that breaks the model


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_failing_step_fails_only_the_request_that_causes_it(default_model, plain_llm, text_ids, overlap):
    """A step that raises does not fail its neighbours: each request of the step goes back
    to the queue and runs its next step alone; the one that fails alone gets the error,
    the others finish with the outputs of a clean run. A one-off failure of a batched
    decode step (with a batch built on it already in flight when overlapping) fails nobody."""
    prompts = distinct_prompts(text_ids, 5, 30, 60, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in plain_llm.generate(prompts, params)]  # a clean run
    assert all(POISON not in p + e for p, e in zip(prompts, expected))
    poisoned = prompts[2][:10] + [POISON] + prompts[2][10:]
    with LLM(str(default_model), overlap_schedule=overlap) as llm:
        runner = llm.engine.runner
        launch = runner.launch
        failed_once: list[int] = []

        def faulty(batch):
            if any(POISON in s.token_ids for s in batch.seqs):
                raise RuntimeError("poisoned input")
            if batch.step >= 8 and len(batch.seqs) >= 3 and not failed_once:
                failed_once.append(batch.step)
                raise RuntimeError("a one-off failure")
            return launch(batch)

        runner.launch = faulty
        outs = llm.generate(prompts[:2] + [poisoned] + prompts[3:], params)
        assert failed_once
        assert outs[2].finish_reason == "error" and "poisoned input" in outs[2].error
        for i in (0, 1, 3, 4):
            assert outs[i].error is None and outs[i].token_ids == expected[i], i
        assert llm.engine.scheduler.counters.isolated_failures >= 2
        settle(llm)
        again = llm.generate(prompts[:2], params)  # the engine serves on, batched as before
        assert [o.token_ids for o in again] == expected[:2]


def test_what_exists_at_start_is_frozen_out_of_the_cyclic_collector_until_stop(default_model, text_ids):
    """A full collection of the ~340k objects of a loaded engine paused the event loop for
    ~180 ms; frozen at start, they are not traversed again (and are thawed at stop)."""
    import gc

    with LLM(str(default_model)) as llm:
        llm.generate([text_ids[:20]], GREEDY)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000
        # what a full collection walks: the objects made since start, far fewer
        assert len(gc.get_objects()) < frozen / 2
    assert gc.get_freeze_count() == 0
