"""bfloat16 over 2 gloo ranks: the all-reduce sums each row-parallel layer's halves in another
order than one rank's GEMM, so bf16 answers are not bit-equal; they must follow one rank's
until a near-tie, with the top-5 logprobs within 5e-2 (the criterion tests/gpu/
test_gpu_tensor_parallel.py applies on NCCL). The tiny Llama-3 has one KV head per rank."""

from __future__ import annotations

import torch

from streamer import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_follows_until_near_tie

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 500, (n,), generator=g).tolist() for n in (5, 40, 90, 130)]


def test_bf16_two_ranks_follow_one_until_a_near_tie(tmp_path):
    # moderate weights: bf16 rounding of large random logits alone would exceed 5e-2
    path = make_tiny_model(tmp_path / "llama", "LlamaForCausalLM", None, initializer_range=0.05)
    batch = prompts()
    with LLM(str(path), dtype="bfloat16", **ENGINE) as llm:
        one = llm.generate(batch, PARAMS)
    with LLM(str(path), dtype="bfloat16", tensor_parallel_size=2, **ENGINE) as llm:
        two = llm.generate(batch, PARAMS)
    assert_follows_until_near_tie(two, one)
