"""The host KV tier on the GPU: pinned pages, copies on their own streams with events.
Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.kv.host import HostTier
from streamer.kv.pages import PagePool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_pages_written_back_survive_the_reuse_of_their_device_pages(dtype):
    """A write-back frees its device pages at once; the next step waits for pool.fence, so a
    kernel overwriting them cannot run before the copy has read them."""
    pool = PagePool(4, 300, 16, 8, 128, dtype, "cuda")
    pool.k.copy_(torch.randn(pool.k.shape, device="cuda").to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, device="cuda").to(dtype))
    want_k, want_v = pool.k[:, 1:129].clone(), pool.v[:, 1:129].clone()
    tier = HostTier(pool, 200 * 2 * 4 * pool.k_bytes.shape[2])
    assert tier.host.data.is_pinned()
    tier.write(list(range(1, 129)), list(range(128)))
    torch.cuda.current_stream().wait_event(pool.fence)  # what the runner does before a step
    pool.k[:, 1:129].zero_()
    pool.v[:, 1:129].zero_()
    ev = tier.load(list(range(128)), list(range(150, 278)))
    ev.synchronize()
    assert torch.equal(pool.k[:, 150:278].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pool.v[:, 150:278].view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sessions_through_a_small_pool_and_the_host_give_the_unbounded_pools_tokens(tmp_path, kv_cache_dtype):
    from tests.conftest import make_tiny_model

    path = str(make_tiny_model(tmp_path / "llama", "LlamaForCausalLM", None, initializer_range=0.05))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def chat(llm: LLM) -> tuple[list[list[int]], int]:
        rng = random.Random(0)
        history = {i: [rng.randrange(10, 40000) for _ in range(40)] for i in range(8)}
        outs, host = [], 0
        for _ in range(4):
            for i in history:
                p = history[i] + [rng.randrange(10, 40000) for _ in range(60)]
                (o,) = llm.generate([p], params)
                outs.append(o.token_ids)
                host += o.cached_host_tokens
                history[i] = p + o.token_ids
        llm.check()
        return outs, host

    common = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, page_size=16)
    with LLM(path, num_pages=2048, **common) as big:
        want, _ = chat(big)
    with LLM(path, num_pages=48, host_kv_cache_gb=0.25, **common) as small:
        got, host = chat(small)
        s = small.stats()
    assert host > 0 and s.host.load_backs > 0 and s.host.write_backs > 0
    assert got == want
