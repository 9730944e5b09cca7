"""Speculative decoding over 2 tensor-parallel ranks (gloo): ngram, a draft model, an
EAGLE-3 and an EAGLE-1 head give the greedy output of transformers, as one rank does. A draft
is whole and on rank 0 alone (no collective in it): its proposals reach the other rank with
the step; an EAGLE head without embeddings of its own reads a whole copy of the target's from
the checkpoint (each rank's target holds a slice), and an EAGLE-1 head the target's LM head. Every verify row's sampled token reaches the
other rank (a verify chunk samples at each of its 1 + k positions)."""

from __future__ import annotations

import pytest

from streamer import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.engine.spec.eagle_heads import make_eagle1_head, make_head
from tests.oracle import Comparison, compare

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], [9] * 20, list(range(300, 340))]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("tp-spec")
    target = make_tiny_model(root / "target", "LlamaForCausalLM", default_model, num_hidden_layers=4)
    draft = make_tiny_model(root / "draft", "Qwen3ForCausalLM", None, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    head = make_head(root / "head", target, draft_vocab=512, layer_ids=[0, 1, 2])
    eagle1 = make_eagle1_head(root / "eagle1", target)
    return target, {
        "eagle": {"method": "eagle", "model": str(eagle1), "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    }


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "eagle"])
def test_two_ranks_speculate_and_answer_as_transformers(models, method):
    target, specs = models
    with LLM(str(target), tensor_parallel_size=2, page_size=4, max_num_batched_tokens=16,
             speculative_config=specs[method]) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        s = llm.stats()
        runner = llm.engine.runner
        if method != "ngram":
            assert runner.draft is not None and runner.draft.model.tp is None  # (whole, on rank 0)
        llm.check()
    assert s.spec_verifies > 0
    cmp = Comparison()
    for p, o in zip(PROMPTS, got):
        compare(target, p, o, cmp)
    assert not cmp.failures, cmp.failures
