"""Sliding-window models: the pages behind every layer's window are released as a request
advances (scheduler/pages.py `trim`), and the radix tree keeps only pages that hold KV.

Page size 4, window 16: a query at position q reads keys q-15..q, so pages wholly before
q-15 are dead; a request holds at most ceil(16/4) + 1 = 5 pages (its window, and the page
its next token goes into). Fake step outputs; `check()` after every step."""

from __future__ import annotations

import pytest

from streamer.engine.request import Status
from tests.engine.scheduler.fakes import finish_step, run_to_end, scheduler, submit

PS, WINDOW = 4, 16
NEED = -(-WINDOW // PS) + 1


def held(req) -> int:
    return len(req.pages) - req.released


def first_read(start: int) -> int:
    """The first page a chunk starting at `start` reads: its first query's window."""
    return max(0, (start - WINDOW + 1) // PS)


@pytest.mark.parametrize(
    "window,caching,most",
    [(WINDOW, False, NEED), (WINDOW, True, NEED), (0, False, 50), (0, True, 50)],
)
def test_a_200_token_request_holds_the_pages_of_its_window_not_50(window, caching, most):
    s = scheduler(page_size=PS, kv_window=window, enable_prefix_caching=caching)
    submit(s, "a", list(range(10, 30)), max_tokens=180)  # 200 tokens in all
    req = s.requests["a"]
    seen = 0
    while (batch := s.schedule()) is not None:
        finish_step(s, batch)
        s.check()
        if req.status == Status.RUNNING:
            seen = max(seen, held(req))
            assert req.released == (first_read(req.num_computed) if window else 0)
            assert s.pool.capacity - s.pool.num_free <= held(req) + s.tree.cached_pages
    assert seen == most
    assert req.num_output == 180
    if caching and window:  # the prompt's 5 pages stay cached; the trimmed output could not join them
        assert s.tree.cached_pages == 5 and s.tree.evictable == 5
    assert s.pool.num_free == s.pool.capacity - s.tree.cached_pages


@pytest.mark.parametrize("caching", [True, False])
def test_a_chunked_prefill_trims_only_once_the_tree_has_the_prompt(caching):
    """With prefix caching the prompt's pages go to the tree first (later arrivals share
    them); without, they are released chunk by chunk."""
    s = scheduler(page_size=PS, kv_window=WINDOW, enable_prefix_caching=caching, max_num_batched_tokens=16)
    submit(s, "a", list(range(10, 70)), max_tokens=30)  # 60 prompt tokens: 4 chunks
    req = s.requests["a"]
    for _ in range(3):
        finish_step(s, s.schedule())
        s.check()
        assert req.released == (0 if caching else first_read(req.num_computed)) and req.num_output == 0
    finish_step(s, s.schedule())  # the last chunk samples: the prompt is in the tree, then trimmed
    s.check()
    assert req.released == first_read(60)
    if caching:
        assert s.tree.cached_pages == 15 and s.tree.evictable == 0, "locked: it still holds pages 11-14"
        while req.num_computed < 75:  # its window has passed the prompt's last page
            finish_step(s, s.schedule())
        assert req.node is None and s.tree.evictable == 15, "it holds none of its prefix: unlocked"
    run_to_end(s)
    s.check()


def test_a_trimmed_cached_prefix_stays_whole_in_the_tree_for_the_next_request():
    s = scheduler(page_size=PS, kv_window=WINDOW)
    prefix = list(range(100, 140))  # 10 pages
    submit(s, "first", prefix + [1], max_tokens=1)
    run_to_end(s)
    tree_pages, _ = s.tree.peek(prefix)
    assert len(tree_pages) == 10
    submit(s, "long", prefix + [2], max_tokens=60)
    finish_step(s, s.schedule())
    long = s.requests["long"]
    assert long.pages[:10] == [0] * first_read(41) + tree_pages[first_read(41) :]
    while long.num_computed < 80:
        finish_step(s, s.schedule())
        s.check()
    assert long.released > 10 and long.node is None
    assert [s.pool.refcount[p] for p in tree_pages] == [1] * 10, "the tree's reference alone"
    assert s.tree.evictable == 10, "no request holds them: they may be evicted"
    submit(s, "third", prefix + [3], max_tokens=4)
    batch = s.schedule()
    third = next(c for c in batch.seqs if c.request_id == "third")
    assert third.start == 40 and third.page_table[:10] == tree_pages
    finish_step(s, batch)
    run_to_end(s)
    s.check()
    assert s.tree.cached_pages == 10 + 1, "long's trimmed output did not join; third's prompt page did"


def test_a_batch_in_flight_keeps_every_page_it_reads():
    """Overlap: batch N's results trim while N+1 runs; N+1's queries start where N ended,
    so the pages of its window are still held."""
    s = scheduler(page_size=PS, kv_window=WINDOW, enable_prefix_caching=False)
    submit(s, "a", list(range(10, 30)), max_tokens=60)
    submit(s, "b", list(range(50, 53)), max_tokens=70)
    checked = 0
    batch = s.schedule()
    while batch is not None:
        ahead = s.schedule(ahead=True)
        finish_step(s, batch)  # trims while `ahead` is in flight
        s.check()
        for seq in ahead.seqs if ahead is not None else []:
            req = s.requests.get(seq.request_id)
            if req is not None:
                read = seq.page_table[first_read(seq.start) :]
                assert set(read) <= set(req.pages[req.released :]), (seq.request_id, seq.start)
                checked += req.released > 0
        if ahead is not None:
            finish_step(s, ahead)
            s.check()
        batch = s.schedule()
    assert checked > 50
    assert s.pool.num_free == s.pool.capacity


@pytest.mark.parametrize("caching", [True, False])
def test_a_trimmed_request_that_is_preempted_recomputes_from_what_the_tree_still_holds(caching):
    # 17 free pages: the add-time check wants room for a whole 68-token request; five
    # requests of 5 pages each do not fit
    s = scheduler(num_pages=18, page_size=PS, kv_window=WINDOW, enable_prefix_caching=caching)
    for i in range(5):
        submit(s, f"r{i}", [20 * i + t for t in range(8)], max_tokens=60)
    trimmed: dict[str, int] = {}  # request -> its length when preempted after trimming
    preempt = s.pages.preempt

    def spy(req):
        if req.released:
            trimmed[req.request_id] = len(req.tokens)
        preempt(req)

    s.pages.preempt = spy
    outputs: dict[str, int] = {}
    resumed = 0
    while (batch := s.schedule()) is not None:
        for seq in batch.seqs:
            if seq.request_id in trimmed and seq.start + len(seq.token_ids) == trimmed[seq.request_id]:
                # resumed: from scratch, or from a prefix whose every page the tree holds
                cached = seq.page_table[: seq.start // PS]
                assert seq.start % PS == 0 and (caching or seq.start == 0), seq.start
                assert 0 not in cached and set(cached) <= set(s.tree.held_pages())
                resumed += 1
                del trimmed[seq.request_id]
        for d in s.process(batch, _tokens(batch)):
            outputs[d.request_id] = outputs.get(d.request_id, 0) + len(d.token_ids)
        s.check()
    assert resumed > 0
    assert outputs == {f"r{i}": 60 for i in range(5)}
    assert s.pool.num_free == s.pool.capacity - s.tree.cached_pages


def _tokens(batch):
    from streamer.messages import SampledToken, StepOutput

    return StepOutput(batch.step, [SampledToken(7) for c in batch.seqs if c.sample])


@pytest.mark.parametrize("window,cached", [(WINDOW, 5), (None, 79 // PS)])
def test_an_engine_takes_the_window_from_the_model_config(tmp_path, window, cached):
    """A Mistral config's sliding_window reaches the scheduler: the output's pages are
    released as it decodes, so only the prompt's pages stay in the tree (without a window,
    every computed page does); and the tokens, decoded over released pages, are still
    transformers' token for token."""
    from streamer import LLM, SamplingParams
    from tests.conftest import make_tiny_model
    from tests.oracle import Comparison, compare

    path = make_tiny_model(tmp_path / "m", "MistralForCausalLM", None, vocab_size=512, sliding_window=window)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", cuda_graphs=False, page_size=PS) as llm:
        assert llm.engine.scheduler.pages.window == (window or 0)
        (out,) = llm.generate([list(range(3, 23))], params)  # 20 + 60 tokens, 79 computed
        assert len(out.token_ids) == 60
        cmp = Comparison()
        compare(path, list(range(3, 23)), out.token_ids, cmp)
        assert not cmp.failures, cmp.failures
        s = llm.wait_idle()
        llm.check()
        assert s.pages_used == s.pages_cached == cached
