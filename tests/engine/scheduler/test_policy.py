"""The scheduling policy on its own (scheduler/policy.py, with the pages, results and
stats it drives): no model, fake step outputs."""

from __future__ import annotations

from streamer.messages import SampledToken, StepOutput
from tests.engine.scheduler.fakes import finish_step, run_to_end, salted, scheduler, submit


def test_a_shared_prefix_is_computed_once_even_when_scheduling_ahead():
    s = scheduler()
    prefix = list(range(100, 300))
    for i in range(6):
        submit(s, f"r{i}", prefix + [1000 + i] * 5)
    first = s.schedule()
    assert [c.request_id for c in first.seqs] == ["r0"], "the others wait for r0's prefix"
    ahead = s.schedule(ahead=True)  # built while `first` runs: r0's prompt is not cached yet
    assert [c.request_id for c in ahead.seqs] == ["r0"]
    finish_step(s, first)
    finish_step(s, ahead)
    third = s.schedule()
    admitted = {c.request_id: c.start for c in third.seqs if c.request_id != "r0"}
    assert admitted and all(start >= 192 for start in admitted.values()), admitted


def test_scheduling_ahead_never_preempts_but_a_plain_schedule_does():
    s = scheduler(num_pages=12)  # 11 usable pages; three requests grow to 9 pages each
    for i in range(3):
        submit(s, f"r{i}", [i + 10] * 40, max_tokens=100)
    batch = s.schedule()
    while batch is not None:
        before = s.counters.preemptions
        ahead = s.schedule(ahead=True)
        assert s.counters.preemptions == before, "a batch in flight may still use the pages"
        finish_step(s, batch)
        if ahead is not None:
            finish_step(s, ahead)
        batch = s.schedule()
    assert s.counters.preemptions > 0
    assert not s.running and not s.waiting
    s.check()


def test_device_time_is_split_into_busy_and_time_spent_waiting_for_the_host():
    """busy: each step's device time less its wait for grammar masks; idle: the gap before a
    step built while another was in flight (the host was late), plus mask waits. The gap
    before a step built with nothing in flight is not counted: the device had no work."""
    s = scheduler()
    submit(s, "a", [5] * 20, max_tokens=8)
    first = s.schedule()
    ahead = s.schedule(ahead=True)
    tok = lambda b: [SampledToken(7) for c in b.seqs if c.sample]  # noqa: E731
    s.process(first, StepOutput(first.step, tok(first), device_time=0.010, idle_before=0.5))
    s.process(ahead, StepOutput(ahead.step, tok(ahead), device_time=0.004, idle_before=0.001, mask_wait=0.002))
    stats = s.stats()
    assert abs(stats.device_busy_s - (0.010 + 0.002)) < 1e-9
    assert abs(stats.device_idle_s - (0.001 + 0.002)) < 1e-9


def test_step_trace_writes_one_line_per_processed_step(tmp_path, monkeypatch):
    import json

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("STREAMER_STEP_TRACE", str(path))
    s = scheduler()
    submit(s, "a", [5] * 20, max_tokens=3)
    first = s.schedule()
    ahead = s.schedule(ahead=True)
    s.process(first, StepOutput(first.step, [SampledToken(7)], device_time=0.01, host_times={"ready": 1.0}))
    s.process(ahead, StepOutput(ahead.step, [SampledToken(7)], idle_before=0.002))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in recs] == [first.step, ahead.step]
    assert recs[0]["tokens"] == 20 and recs[0]["decodes"] == 0 and recs[0]["ready"] == 1.0
    assert recs[1]["ahead"] and recs[1]["decodes"] == 1 and recs[1]["idle_before"] == 0.002
    assert recs[1]["processed"] >= recs[1]["process_begin"]


def test_decodes_lead_the_batch_longest_context_first():
    s = scheduler(max_num_batched_tokens=64)
    submit(s, "short", [5] * 20, max_tokens=50)
    finish_step(s, s.schedule())
    submit(s, "long", [6] * 50, max_tokens=50)
    finish_step(s, s.schedule())
    submit(s, "chunked", [7] * 100, max_tokens=50)  # 62 tokens this step, 38 the next
    finish_step(s, s.schedule())
    batch = s.schedule()
    assert [(c.request_id, len(c.token_ids)) for c in batch.seqs] == [("long", 1), ("short", 1), ("chunked", 38)]
    assert [c.start for c in batch.seqs] == [51, 22, 62]


def test_a_request_cached_but_its_last_token_joins_the_leading_decodes():
    """Its one new token needs only a decode's attention: placed among the leading one-token
    chunks, not after a running prefill, it can go through the decode kernel in a mixed step."""
    s = scheduler(max_num_batched_tokens=256)
    prompt = list(range(100, 133))  # two full pages (32 tokens) can be cached
    submit(s, "first", prompt, max_tokens=50)
    finish_step(s, s.schedule())
    submit(s, "big", [9] * 300, max_tokens=50)  # 255 tokens next to first's decode, then 45
    finish_step(s, s.schedule())
    submit(s, "again", prompt, max_tokens=50)  # 32 tokens cached: its last one is computed
    batch = s.schedule()
    assert [(c.request_id, len(c.token_ids), c.start) for c in batch.seqs] == [
        ("first", 1, 34), ("again", 1, 32), ("big", 45, 255)
    ]
    assert batch.seqs[1].sample


def test_a_full_batch_does_not_walk_the_cache_for_waiting_prompts(monkeypatch):
    s = scheduler(max_num_seqs=2)
    for i in range(4):
        submit(s, f"r{i}", [i + 10] * 40, max_tokens=50)
    finish_step(s, s.schedule())  # r0 and r1 admitted; r2 and r3 wait
    walks = []
    real = s.tree.peek
    monkeypatch.setattr(s.tree, "peek", lambda tokens: walks.append(len(tokens)) or real(tokens))
    batch = s.schedule()
    assert sorted(c.request_id for c in batch.seqs) == ["r0", "r1"]
    assert walks == [], "nobody can be admitted: the waiting prompts are not looked up"
    finish_step(s, batch)


def test_requests_share_cached_pages_only_within_their_cache_salt():
    s = scheduler()
    prompt = list(range(100, 164))  # 4 pages; 3 full pages (48 tokens) can come from the cache
    cached = {}
    for rid, salt in [("plain", None), ("plain2", None), ("alice", "a"), ("alice2", "a"), ("bob", "b")]:
        salted(s, rid, prompt, salt)
        cached[rid] = run_to_end(s)[rid][0].cached_tokens
        s.check()
    assert cached == {"plain": 0, "plain2": 48, "alice": 0, "alice2": 48, "bob": 0}
    assert set(s.tree.spaces) == {"a", "b"}
    assert s.stats().pages_used == s.stats().pages_cached == 3 * 4, "one copy of the prompt per namespace"


def test_requests_of_other_salts_do_not_wait_for_a_shared_prefix_to_be_computed():
    """Same-salt requests on one prefix wait for the first to cache it (claim); another salt
    cannot use that page, so it is admitted at once and computes its own."""
    s = scheduler()
    prompt = list(range(100, 300))
    for rid, salt in [("a0", "a"), ("a1", "a"), ("b0", "b")]:
        salted(s, rid, prompt + [1000 + len(rid)], salt)
    first = s.schedule()
    assert sorted(c.request_id for c in first.seqs) == ["a0", "b0"]
    finish_step(s, first)
    run_to_end(s)
    s.check()


def prioritized(s, rid: str, prompt: list[int], priority: int, max_tokens: int = 4) -> None:
    from streamer.messages import SamplingParams, TokenizedRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority)
    assert s.add(TokenizedRequest(request_id=rid, prompt_token_ids=prompt, params=params, eos_token_ids=[2])) is None


def test_the_priority_policy_admits_lower_priority_values_first_and_preempts_the_last():
    """scheduling_policy priority (vLLM's): waiting requests are admitted by priority (lower
    first), arrival breaking ties; a request that cannot grow preempts the running request last
    by (priority, arrival), not the newest; fcfs keeps arrival order."""
    s = scheduler(max_num_seqs=2, scheduling_policy="priority", enable_prefix_caching=False)
    for rid, prio in (("late-low", 5), ("urgent", -1), ("mid-a", 1), ("mid-b", 1)):
        prioritized(s, rid, [10 + len(rid)] * 8, prio)
    first = s.schedule()
    assert [c.request_id for c in first.seqs] == ["urgent", "mid-a"]
    finish_step(s, first)
    fcfs = scheduler(max_num_seqs=2, enable_prefix_caching=False)
    for rid in ("late-low", "urgent", "mid-a"):
        prioritized(fcfs, rid, [10 + len(rid)] * 8, 0)
    assert [c.request_id for c in fcfs.schedule().seqs] == ["late-low", "urgent"]
    # 11 usable pages: the high-priority request, admitted after the low one (the newest), grows
    # until the running low-priority one goes (fcfs would preempt the newest: "high")
    tight = scheduler(num_pages=12, max_num_seqs=4, scheduling_policy="priority", enable_prefix_caching=False)
    prioritized(tight, "low", [20] * 40, 9, max_tokens=100)
    finish_step(tight, tight.schedule())
    prioritized(tight, "high", [21] * 40, 0, max_tokens=100)
    batch = tight.schedule()
    assert [r.request_id for r in tight.running] == ["low", "high"]
    while batch is not None and tight.counters.preemptions == 0:
        finish_step(tight, batch)
        batch = tight.schedule()
    assert tight.counters.preemptions == 1
    assert [r.request_id for r in tight.running] == ["high"] and [r.request_id for r in tight.waiting] == ["low"]
    run_to_end(tight)
    tight.check()


def test_the_policy_is_named_by_the_flag_and_checked():
    import argparse

    import pytest

    from streamer.cli import add_engine_args, engine_config
    from streamer.config import EngineConfig
    from streamer.errors import ConfigError

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    assert engine_config(p.parse_args([])).scheduling_policy == "fcfs"
    with pytest.raises(ConfigError, match="scheduling_policy must be fcfs or priority, not 'lifo'"):
        EngineConfig(scheduling_policy="lifo")
