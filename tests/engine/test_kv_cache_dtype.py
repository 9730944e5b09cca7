"""kv_cache_dtype "fp8": K/V pages in float8 e4m3 (scale 1).

The oracle is transformers with its K/V cache rounded to float8 the same way
(tests.oracle.fp8_kv_cache): greedy outputs must then match token for token,
whatever the batching, chunking, page size or cache state, as for full precision.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.messages import GenerateRequest
from tests.engine.test_engine import distinct_prompts, settle, text_ids  # noqa: F401 (fixture)
from tests.oracle import Comparison, compare, hf_greedy

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_unknown_kv_cache_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_pages_match_transformers_with_an_fp8_cache(default_model, text_ids, page_size):  # noqa: F811
    # a shared prefix (served from the radix cache the second time) and prompts chunked over
    # several steps, decoded together
    prefix = text_ids[:40]
    prompts = [prefix + p for p in distinct_prompts(text_ids, 3, 5, 30, seed=3)]
    prompts += distinct_prompts(text_ids, 3, 20, 90, seed=8)  # (the prompts of the next test)
    with LLM(str(default_model), kv_cache_dtype="fp8", page_size=page_size, max_num_batched_tokens=48) as llm:
        assert llm.engine.runner.pool.k.dtype == torch.float8_e4m3fn

        async def scenario():
            async def one(i, p):
                await asyncio.sleep(0.05 * i)
                req = GenerateRequest(request_id=f"f{i}", prompt_token_ids=p, params=GREEDY)
                return await llm.engine.generate(req)

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        outs = llm.call(scenario())
        assert llm.stats().cached_tokens_total > 0, "the shared prefix came from the cache"
        settle(llm)
    cmp = Comparison()
    for p, o in zip(prompts, outs):
        compare(default_model, p, o.token_ids, cmp, kv_fp8=True)
    assert not cmp.failures, cmp.failures


def test_the_fp8_oracle_differs_from_full_precision(default_model, text_ids):  # noqa: F811
    """The test above would be empty if rounding K/V to float8 changed nothing: over its
    chunked prompts (their float8 references already computed there) it changes some
    continuation. (Seed 8: each of its three prompts changes with transformers 5.24 and the
    default model as converted there; seed 4's changed none, their logits only.)"""
    prompts = distinct_prompts(text_ids, 3, 20, 90, seed=8)
    changed = (
        hf_greedy(str(default_model), tuple(p), 16, True).tokens
        != hf_greedy(str(default_model), tuple(p), 16).tokens
        for p in prompts
    )
    assert any(changed)


def test_fp8_pool_holds_four_times_the_tokens_of_float32(default_model):
    sizes = {}
    for kv in ("auto", "fp8"):
        with LLM(str(default_model), kv_cache_dtype=kv, cpu_kv_bytes=64 << 20) as llm:
            pool = llm.engine.runner.pool
            sizes[kv] = pool.num_pages
            assert pool.k.element_size() == (4 if kv == "auto" else 1)  # float32 on CPU
    assert sizes["fp8"] == 4 * sizes["auto"]
