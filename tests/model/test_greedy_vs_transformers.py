"""Greedy output equals transformers generate() token for token (float32, CPU),
whatever the batching, prefill chunk size or page size."""

from __future__ import annotations

import random

import pytest

from streamer import LLM, SamplingParams
from tests.oracle import Comparison, compare

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:",
]


def prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi tokens: real text repeated and cut to a random length."""
    rng = random.Random(seed)
    base = tokenizer(" ".join(TEXTS * 40))["input_ids"]
    out = []
    for i in range(n):
        length = lo + (hi - lo) * i // max(n - 1, 1)
        start = rng.randrange(0, len(base) - length)
        out.append(base[start : start + length])
    return out


def run_and_compare(llm: LLM, path, batch: list[list[int]], params: SamplingParams) -> Comparison:
    outs = llm.generate(batch, params)
    cmp = Comparison()
    for p, o in zip(batch, outs):
        assert o.error is None, o.error
        compare(path, p, o.token_ids, cmp)
    llm.check()
    stats = llm.stats()
    assert stats.running == 0
    assert stats.pages_used == stats.pages_cached, "every page is free or held by the cache"
    return cmp


def assert_matches(cmp: Comparison, total: int) -> None:
    assert not cmp.failures, "\n".join(cmp.failures)
    assert cmp.exact + cmp.near_ties == total
    print(f"exact {cmp.exact}/{total}, near-ties {cmp.near_ties}")


def test_default_model_batch_of_8_prompts_matches_transformers(default_model):
    with LLM(str(default_model)) as llm:
        batch = prompts(llm.tokenizer, 8, 5, 300)
        assert_matches(run_and_compare(llm, default_model, batch, GREEDY), 8)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_tiny_random_models_match_transformers(tiny_models, family):
    path = tiny_models[family]
    with LLM(str(path)) as llm:
        batch = prompts(llm.tokenizer, 6, 5, 200, seed=1)
        assert_matches(run_and_compare(llm, path, batch, GREEDY), 6)


@pytest.mark.parametrize(
    "chunk,page_size,n,lo,hi",
    [(1, 16, 2, 5, 24), (7, 1, 4, 5, 60), (7, 16, 4, 5, 60), (64, 1, 4, 20, 150), (64, 16, 4, 20, 150)],
)
def test_chunk_and_page_size_do_not_change_output(tiny_models, chunk, page_size, n, lo, hi):
    path = tiny_models["qwen3"]
    params = SamplingParams(max_tokens=8 if chunk == 1 else 16, temperature=0, ignore_eos=True)
    with LLM(str(path), max_num_batched_tokens=chunk, page_size=page_size) as llm:
        batch = prompts(llm.tokenizer, n, lo, hi, seed=2)
        alone = [llm.generate([p], params)[0].token_ids for p in batch]
        together = [o.token_ids for o in llm.generate(batch, params)]
        assert alone == together
        assert_matches(run_and_compare(llm, path, batch, params), n)


def test_mixed_steps_with_decodes_split_from_the_prefill(tiny_models, monkeypatch):
    """A step of decodes and prefill chunks may send its leading decodes through the decode
    kernel and the rest through the extend kernel (the runner does so past
    split_decode_tokens of decode context; 0 here, so every mixed step splits): same tokens."""
    from kernels import ops

    split_steps = []
    real = ops.paged_attention

    def spy(*args, **kwargs):
        if kwargs.get("num_decodes", args[10] if len(args) > 10 else 0):
            split_steps.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_attention", spy)
    path = tiny_models["llama3"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(path), max_num_batched_tokens=48, page_size=4) as llm:
        llm.engine.runner.split_decode_tokens = 0
        batch = prompts(llm.tokenizer, 5, 5, 160, seed=3)  # short ones decode while long ones prefill
        assert_matches(run_and_compare(llm, path, batch, params), 5)
    assert split_steps, "no mixed step split its attention"
