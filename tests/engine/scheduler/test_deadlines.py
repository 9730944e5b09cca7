"""Deadlines (SamplingParams.timeout) in the policy: a request ends "timeout" wherever it
is, and its pages are freed once no batch in flight holds them."""

from __future__ import annotations

import time

from streamer.messages import SamplingParams, TokenizedRequest
from tests.engine.scheduler.fakes import finish_step, salted, scheduler


def test_a_deadline_ends_queued_and_running_requests_and_frees_their_pages():
    s = scheduler(max_num_seqs=1)
    salted(s, "running", [5] * 40, None, timeout=5.0)
    salted(s, "queued", [6] * 40, None, timeout=1.0)  # waits: one request runs at a time
    batch = s.schedule()
    assert [c.request_id for c in batch.seqs] == ["running"]
    now = time.monotonic()
    assert s.next_deadline() is not None and s.next_deadline() <= now + 1.0
    assert s.expire(now) == [], "nothing is due yet"
    (queued,) = s.expire(now + 2.0)
    assert (queued.request_id, queued.finish_reason) == ("queued", "timeout") and "queued" in queued.error
    assert not s.waiting
    (running,) = s.expire(now + 6.0)  # its batch is still in flight: the pages wait for it
    assert (running.request_id, running.finish_reason) == ("running", "timeout") and "running" in running.error
    assert "running" in s.pages.zombies
    s.check()
    finish_step(s, batch)  # the batch is back: the pages go to the tree or the free list
    assert not s.pages.zombies and not s.has_work and s.next_deadline() is None
    s.check()
    st = s.stats()
    assert st.pages_used == st.pages_cached


def test_a_request_past_its_deadline_on_arrival_is_refused_at_once():
    s = scheduler()
    params = SamplingParams(max_tokens=4, timeout=0.5)
    late = TokenizedRequest(request_id="late", prompt_token_ids=[5] * 8, params=params, eos_token_ids=[2],
                            arrival=time.monotonic() - 1.0)  # (its time went in the tokenizer)
    d = s.add(late)
    assert d is not None and d.finish_reason == "timeout" and not s.has_work
