"""Speculative decoding with the host KV tier: a prefix that left the device for the host comes
back with the draft's KV of its pages (and an EAGLE head's KV and features), so proposals after a
load-back are what they would have been had the prefix never left (kv/host.py: the pool's
companions)."""

from __future__ import annotations

from typing import Any

import pytest

from streamer import LLM, SamplingParams
from streamer.model.draft import DraftModel
from tests.engine.spec.eagle_heads import reference_proposals
from tests.engine.spec.test_eagle import assert_proposals_follow, pair  # noqa: F401 - (pair: a fixture)

PS = 4
TIGHT = {"page_size": PS, "num_pages": 24, "host_kv_cache_gb": 0.01}
"""24 pages of 4 tokens: a second long request pushes the first one's prefix to the host."""

FIRST = [(i * 37) % 900 + 20 for i in range(40)]
SECOND = [(i * 53) % 900 + 21 for i in range(60)]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def turns(llm: LLM) -> tuple[list[list[int]], int]:
    """FIRST, SECOND (which evicts FIRST's pages to the host), then FIRST's conversation continued:
    the outputs and the prompt tokens of the last turn that came from the host."""
    one = llm.generate([FIRST], GREEDY)[0]
    two = llm.generate([SECOND], GREEDY)[0]
    three = llm.generate([FIRST + one.token_ids + [7, 8, 9]], GREEDY)[0]
    return [one.token_ids, two.token_ids, three.token_ids], three.cached_host_tokens


def acceptance(target: str, spec: dict[str, Any]) -> tuple[float, list[list[int]], int]:
    with LLM(target, speculative_config=spec, **TIGHT) as llm:
        outs, from_host = turns(llm)
        s = llm.stats()
        llm.check()
    assert s.host is not None and s.host.load_backs > 0
    return s.spec_accepted_tokens / s.spec_draft_tokens, outs, from_host


def test_a_draft_drafting_for_itself_keeps_its_proposals_after_a_load_back(tiny_models, monkeypatch):
    """The tiny target drafting for itself keeps nearly every proposal, also on the turn whose
    prefix came back from the host; without the draft's pages in the host pages (the control)
    its KV there is another prefix's, and it keeps far fewer. Greedy output is the plain one."""
    target = str(tiny_models["llama3"])
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    with LLM(target, page_size=PS) as plain:
        want, _ = turns(plain)
    kept, got, from_host = acceptance(target, spec)
    assert got == want
    assert from_host >= 40, "the third turn's prefix came back from the host"
    assert kept >= 0.9, kept
    monkeypatch.setattr(DraftModel, "page_parts", lambda self: [])
    kept_unmoved, got_unmoved, _ = acceptance(target, spec)
    assert got_unmoved == want, "(the output never depends on the draft)"
    assert kept_unmoved < kept - 0.15, (kept_unmoved, kept)


def test_an_eagle_heads_proposals_after_a_load_back_are_the_references(pair):  # noqa: F811
    """Every proposal of every verify, the third turn's after its prefix came back from the host
    included, is the reference's (transformers' features, the head with no KV cache): the head's
    KV and features of the host's pages came back with them."""
    target, head = pair
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    first = FIRST[:24]
    prompts = [first, SECOND, first + [11, 12, 13]]  # (the third reuses the first's cached prefix)
    checked = assert_proposals_follow(target, spec, prompts,
                                      lambda hf, tokens, k: reference_proposals(hf, head, tokens, k, [1, 2, 3]),
                                      **TIGHT)
    assert checked >= 30


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_the_host_pages_hold_the_drafts_bytes_too(pair, method):  # noqa: F811
    """A host page is the target's KV then the draft's (then an EAGLE head's features)."""
    target, head = pair
    draft = str(head) if method == "eagle3" else str(target)
    with LLM(str(target), speculative_config={"method": method, "model": draft}, **TIGHT) as llm:
        runner = llm.engine.runner
        tier = llm.engine.scheduler.tree.tier
        own = sum(p.shape[0] * p.shape[2] for p in (runner.pool.k_bytes, runner.pool.v_bytes))
        extra = sum(p.shape[0] * p.shape[2] for p in runner.draft.page_parts())
        assert len(runner.draft.page_parts()) == (3 if method == "eagle3" else 2)
        assert tier.host.page_bytes == own + extra
