"""DeepSeek-V2/V3 on the GPU (bf16; kernels/mla_decode.py for decodes, kernels/mla.py's torch
attention for prefill, the fused MoE kernel, no CUDA graphs): greedy output follows transformers up to the first near-tie; the latent
pool's pages round-trip through the pinned host tier. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.kv.host import HostTier
from streamer.kv.pages import PagePool
from tests.gpu.test_gpu_architectures import MOE_PARTING
from tests.gpu.test_gpu_correctness import hf_steps, prompts
from tests.model.test_deepseek import CONFIGS, YARN, perturb

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("deepseek-gpu")
    out = {}
    for arch, cfg in CONFIGS.items():
        # (prompts up to 300 tokens: YaRN's original length a quarter of the table's, as on the CPU)
        kw = {**cfg, "max_position_embeddings": 1024}
        if "rope_parameters" in kw:
            kw["rope_parameters"] = {**YARN, "original_max_position_embeddings": 256}
        out[arch] = make_tiny_model(root / arch, arch, None, initializer_range=0.05, **kw)
        perturb(out[arch])
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_bf16_greedy_follows_transformers_until_a_near_tie(models, arch):
    path = models[arch]
    batch = prompts()
    with LLM(str(path), dtype="bfloat16", num_pages=4096) as llm:
        assert llm.engine.runner.graphs is None, "MLA runs eagerly (kernels/mla.py synchronizes)"
        outs = llm.generate(batch, PARAMS) + [llm.generate([batch[-1]], PARAMS)[0]]
    batch = batch + [batch[-1]]
    agreed = 0
    for p, o in zip(batch, outs):
        ref, logps = hf_steps(path, p, PARAMS.max_tokens)
        for i, (a, b) in enumerate(zip(o.token_ids, ref)):
            if a != b:
                assert abs(logps[i][a] - logps[i][b]) <= MOE_PARTING, (arch, i, a, b)
                break
            agreed += 1
    assert agreed >= 0.5 * len(batch) * PARAMS.max_tokens


def test_latent_pages_round_trip_through_the_pinned_host_tier():
    pool = PagePool(4, 300, 16, 1, 576, torch.bfloat16, "cuda", shared_v=512)
    pool.k.copy_(torch.randn(pool.k.shape, device="cuda").to(torch.bfloat16))
    want = pool.k[:, 1:129].clone()
    tier = HostTier(pool, 200 * 4 * pool.k_bytes.shape[2])
    assert tier.host.data.is_pinned() and tier.host.data.shape[1] == 1  # K alone
    tier.write(list(range(1, 129)), list(range(128)))
    torch.cuda.current_stream().wait_event(pool.fence)
    pool.k[:, 1:129].zero_()
    ev = tier.load(list(range(128)), list(range(150, 278)))
    ev.synchronize()
    assert torch.equal(pool.k[:, 150:278], want)
    assert torch.equal(pool.v[:, 150:278], want[..., :512])
