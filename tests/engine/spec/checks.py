"""What the speculative-decoding tests check after a run: the engine settles with every page
free or cached, and greedy output with a speculative config is transformers' greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamer import LLM, SamplingParams
from tests.oracle import Comparison, compare

PROMPTS = [[5, 17, 99, 5, 17, 300, 41], [7] * 3 + list(range(100, 130)), [1, 2, 3]]
"""A repeat in the prompt (ngram's and a draft's chance), a longer one (chunked at 16 tokens),
a short one."""


def settle(llm: LLM) -> None:
    s = llm.wait_idle()
    llm.check()
    assert s.running == 0 and s.waiting == 0
    assert s.pages_used == s.pages_cached, "every page is free or held by the cache"


def assert_greedy_unchanged(target: Path, spec: dict[str, Any], params: SamplingParams, *, page_size: int,
                            pages: int | None, overlap: bool) -> None:
    """PROMPTS batched through target with spec (16-token chunks; pages: few enough to preempt,
    or None) give transformers' greedy output, and proposals were verified."""
    with LLM(str(target), page_size=page_size, num_pages=pages, max_num_batched_tokens=16,
             speculative_config=spec, overlap_schedule=overlap) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        s = llm.stats()
        settle(llm)
    assert s.spec_verifies > 0 and s.spec_draft_tokens >= s.spec_verifies
    assert (s.preemptions > 0) == (pages is not None)
    cmp = Comparison()
    for p, o in zip(PROMPTS, got):
        compare(target, p, o, cmp)
    assert not cmp.failures, cmp.failures
