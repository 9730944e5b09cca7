"""ngram speculation on a tiny random Llama: greedy output equals transformers' generate and
the plain engine's, at page sizes 1 and 16 (random weights repeat themselves: proposals hit)."""

from __future__ import annotations

import pytest

from streamer import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.oracle import Comparison, compare


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model):
    # (a small initializer_range: the random model falls into loops, which prompt lookup predicts)
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "LlamaForCausalLM", default_model,
                           initializer_range=0.02)


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_random_model_greedy_equals_transformers(tiny, page_size):
    prompts = [[5, 17, 99, 5, 17, 300, 41], [7] * 3 + list(range(100, 140)), [1, 2, 3]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(str(tiny), page_size=page_size, speculative_config=spec, max_num_batched_tokens=16) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        s = llm.stats()
        llm.wait_idle()
        llm.check()
    assert s.spec_accepted_tokens > 0
    cmp = Comparison()
    for p, o in zip(prompts, got):
        compare(tiny, p, o, cmp)
    assert not cmp.failures, cmp.failures
