"""The scheduler with a host tier (--host-kv-cache-gb): sessions whose histories outgrow the
device pool come back as host hits; loads in flight (simulated on CPU) leak nothing."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.kv.pages import PagePool
from streamer.messages import SampledToken, StepOutput
from tests.engine.scheduler.fakes import finish_step, run_to_end, scheduler, submit

PS = 16
PAGE_BYTES = PagePool.bytes_per_page(1, PS, 1, 4, torch.float32)


def tiered(num_pages: int, host_pages: int, **kw):
    return scheduler(num_pages=num_pages, page_size=PS, host_kv_cache_gb=host_pages * PAGE_BYTES / (1 << 30), **kw)


def chat(s, sessions: int = 16, turns: int = 6, new: int = 24, out: int = 8) -> list[list[int]]:
    """Round-robin multi-turn chats: each turn's prompt is the history plus new tokens."""
    history = {i: [1000 + i] * 3 for i in range(sessions)}
    outputs: dict[str, list[int]] = {}
    for t in range(turns):
        for i in range(sessions):
            prompt = history[i] + [2000 + 37 * i + t + j for j in range(new)]
            rid = f"s{i}t{t}"
            submit(s, rid, prompt, max_tokens=out)
            deltas = run_to_end(s)
            ids = [tok for d in deltas[rid] for tok in d.token_ids]
            outputs[rid] = ids
            history[i] = prompt + ids
            s.check()
    return [outputs[k] for k in sorted(outputs)]


def test_sessions_that_outgrow_the_device_pool_keep_their_prefix_hits_through_the_host():
    working_set = 16 * (6 * 32 + 3) // PS  # pages of every history at its longest
    unbounded = scheduler(num_pages=4 * working_set, page_size=PS)
    chat(unbounded)
    optimal = unbounded.counters.cached_tokens_total
    assert optimal > 0
    small = working_set // 4
    without = scheduler(num_pages=small, page_size=PS)
    chat(without)
    assert without.counters.cached_tokens_total < 0.1 * optimal, "the pool alone forgets every history"
    with_tier = tiered(small, 2 * working_set)
    chat(with_tier)
    got = with_tier.counters.cached_tokens_total
    assert got >= 0.9 * optimal, (got, optimal)
    host = with_tier.counters.cached_host_tokens_total
    assert host >= 0.8 * got, "the returning turns' prefixes came back from the host"
    tier = with_tier.tree.tier
    assert tier.write_backs > 0 and tier.load_backs > 0


class Clock:
    """Simulated copy completion: an event is done once `now` passes its due step."""

    def __init__(self) -> None:
        self.now = 0


class FakeEvent:
    def __init__(self, clock: Clock, delay: int) -> None:
        self.clock, self.due = clock, clock.now + delay

    def query(self) -> bool:
        return self.clock.now >= self.due


def asynchronous(s, clock: Clock, rng: random.Random) -> None:
    """Make the tier's loads complete some steps later, as they do on CUDA."""
    tier = s.tree.tier
    load = tier.load
    tier.load = lambda host, gpu: (load(host, gpu), FakeEvent(clock, rng.randint(0, 3)))[1]
    tier.marker = lambda: FakeEvent(clock, rng.randint(0, 3))


def test_a_request_waits_for_its_load_while_others_run():
    clock = Clock()
    s = tiered(12, 32)
    asynchronous(s, clock, random.Random(0))
    s.tree.tier.marker = lambda: FakeEvent(clock, 2)
    load = s.tree.tier.load
    s.tree.tier.load = lambda h, g: (load(h, g), FakeEvent(clock, 2))[1]
    submit(s, "a", [5] * 64, max_tokens=1)
    run_to_end(s)
    submit(s, "b", [6] * 150, max_tokens=1)
    run_to_end(s)  # a's pages went to the host to make room
    assert s.tree.host_path([5] * 64)
    submit(s, "a2", [5] * 64 + [9] * 4, max_tokens=2)
    submit(s, "c", [8] * 20, max_tokens=2)
    batch = s.schedule()
    assert [c.request_id for c in batch.seqs] == ["c"], "a2 waits for its copy"
    assert s.next_deadline() is not None, "the loop wakes up to look at the copy again"
    clock.now += 2
    finish_step(s, batch)
    batch = s.schedule()
    assert "a2" in [c.request_id for c in batch.seqs]
    a2 = s.requests["a2"]
    assert a2.cached_tokens == 64 and a2.cached_host_tokens == 64
    run_to_end(s)
    s.check()


def test_an_abort_during_a_load_unlocks_once_the_copy_is_done():
    clock = Clock()
    s = tiered(12, 32)
    asynchronous(s, clock, random.Random(0))
    s.tree.tier.load = (lambda load: lambda h, g: (load(h, g), FakeEvent(clock, 5))[1])(s.tree.tier.load)
    submit(s, "a", [5] * 64, max_tokens=1)
    run_to_end(s)
    submit(s, "b", [6] * 150, max_tokens=1)
    run_to_end(s)
    submit(s, "a2", [5] * 64 + [9] * 4, max_tokens=2)
    assert s.schedule() is None
    s.finish("a2", "abort")
    assert s.tree.evictable < s.tree.cached_pages, "the copy in flight keeps its pages locked"
    clock.now += 5
    s.schedule()
    assert s.tree.evictable == s.tree.cached_pages and not s.loads.orphans
    s.check()
    s.tree.reset()
    assert s.pool.num_free == s.pool.capacity


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "step", "abort", "tick"]), st.integers(0, 1 << 30)),
                min_size=1, max_size=60))
def test_random_traffic_with_loads_in_flight_leaks_nothing(ops):
    """Submits over shared prefixes, steps (preempting in a small pool), aborts of waiting,
    loading and running requests, copies completing out of order: after each op the page
    invariant holds on both tiers; once everything ends, nothing is locked or lost."""
    clock = Clock()
    rng = random.Random(len(ops))
    s = tiered(14, 20)
    asynchronous(s, clock, rng)
    n = 0
    in_flight = []
    for op, x in ops:
        if op == "submit":
            prefix = [100 + x % 5] * (16 * (1 + x % 4))
            submit(s, f"r{n}", prefix + [x % 97] * (1 + x % 20), max_tokens=1 + x % 40)
            n += 1
        elif op == "step":
            if in_flight:
                batch = in_flight.pop(0)
                s.process(batch, StepOutput(batch.step, [SampledToken(7) for c in batch.seqs if c.sample]))
            batch = s.schedule(ahead=bool(in_flight))
            if batch is not None:
                in_flight.append(batch)
        elif op == "abort" and s.requests:
            rid = sorted(s.requests)[x % len(s.requests)]
            s.finish(rid, "abort")
        else:
            clock.now += 1
        s.check()
    for batch in in_flight:
        s.process(batch, StepOutput(batch.step, [SampledToken(7) for c in batch.seqs if c.sample]))
    s.abort_all()
    clock.now += 10
    s.schedule()
    s.check()
    assert not s.loads.pending and not s.loads.orphans
    assert s.tree.evictable == s.tree.cached_pages, "a lock outlived its request"
    s.tree.reset()
    assert s.pool.num_free == s.pool.capacity and s.tree.tier.host.num_free == s.tree.tier.host.num_pages


def test_a_kept_session_history_survives_host_pressure_until_its_key_is_aborted():
    from streamer.messages import SamplingParams, TokenizedRequest

    s = tiered(12, 12)  # 11 device pages, 12 host pages
    history = [5] * 64  # 4 pages
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, keep_prefix="ws-a")
    assert s.add(TokenizedRequest(request_id="a1", prompt_token_ids=history, params=params, eos_token_ids=[2])) is None
    run_to_end(s)
    for i in range(6):  # other traffic: 6 x 4 pages through a device pool of 11 and a host of 12
        submit(s, f"o{i}", [10 + i] * 64, max_tokens=1)
        run_to_end(s)
        s.check()
    kept = sum(len(n.key) for n in s.tree.host_path(history)) + 16 * len(s.tree.match_prefix(history)[0])
    assert kept == 64, "the session's history stayed (device or host)"
    assert s.finish("ws-a", "abort") is None and not s.keeps.kept, "abort(key) ends the pin"
    for i in range(6):
        submit(s, f"p{i}", [30 + i] * 64, max_tokens=1)
        run_to_end(s)
    assert s.tree.host_path(history) == [] and s.tree.match_prefix(history)[0] == []
    s.check()
