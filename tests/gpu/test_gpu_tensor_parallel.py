"""Tensor parallelism over 2 GPUs (NCCL for activations, gloo for the step messages; bf16,
the Triton kernels, CUDA graphs): greedy output follows one GPU's until a near-tie, with the
top-5 logprobs within 5e-2, on a batch that mixes a cached prefix, chunked prefill and
preemption; and for a mixture of experts, with experts split over their intermediate size.
Skipped with fewer than 2 GPUs (benchmarks/gpu_run.sh tp2 runs it on nvidia-h200-x2)."""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.distributed.workload import ENGINE, assert_follows_until_near_tie
from tests.gpu.test_gpu_architectures import MOE_PARTING

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import make_tiny_model, tiny_family
    from tests.model.test_moe import ARCHS as MOE

    root = tmp_path_factory.mktemp("tp-gpu")
    out = tiny_family(root, None, initializer_range=0.05)
    arch, kw = MOE["qwen3_moe"]
    out["qwen3_moe"] = make_tiny_model(root / "qwen3_moe", arch, None, initializer_range=0.05, **kw)
    return out


def batch() -> list[list[int]]:
    """A shared 48-token prefix (cached by the first request) and prompts of 5-300 tokens: with
    ENGINE's 48-token steps and 24 pages, chunked prefill and preemption."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, 40000, (48,), generator=g).tolist()
    rest = [torch.randint(10, 40000, (int(n),), generator=g).tolist() for n in torch.linspace(5, 300, 5)]
    return [prefix + rest[0], prefix + rest[1], *rest[2:]]


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_two_gpus_follow_one_until_a_near_tie(models, name):
    prompts = batch()

    def run(**kw):
        with LLM(str(models[name]), dtype="bfloat16", **ENGINE, **kw) as llm:
            llm.generate([prompts[0][:48]], SamplingParams(max_tokens=1, temperature=0))  # the prefix, cached
            outs = llm.generate(prompts, PARAMS)
            return outs, llm.stats().preemptions

    one, _ = run()
    two, preempted = run(tensor_parallel_size=2)
    assert preempted > 0, "the pool is small enough that the scheduler preempts"
    assert two[0].cached_tokens >= 48 and two[1].cached_tokens >= 48
    # a mixture of experts can route a token elsewhere where two experts score alike (MOE_PARTING)
    assert_follows_until_near_tie(two, one, bound=MOE_PARTING if name == "qwen3_moe" else 5e-2)
