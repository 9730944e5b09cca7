"""Tensor parallelism over 2 ranks of tiny random Gemma 2, Gemma 3, Phi-3, Mixtral and
Qwen3-MoE models on gloo:
the answers of one rank (greedy tokens, prompt logprobs within 1e-4) on the workload of
tests/distributed/workload.py (a cached prefix, chunked prefill, preemption). Gemma's
extra norms, scaled embedding, capped scores and logits and sliding windows, and Phi-3's
fused checkpoint tensors (read by each rank as the slices of their q, k, v and gate, up
parts), and experts split over their intermediate size (Mixtral's per-expert w1/w3/w2,
Qwen3-MoE's dense first layer beside sparse ones) are what these add to the Llama
family's tests."""

from __future__ import annotations

import pytest

from streamer import LLM
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, run
from tests.model.test_architectures import ARCHS as DENSE
from tests.model.test_moe import ARCHS as MOE

ARCHS = {**DENSE, **MOE}


def _fuse_experts(path, experts: int) -> None:
    """Layer 1's per-expert tensors of a Mixtral folder as transformers' stacked ones
    (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I], mlp.gate)."""
    import torch

    from tests.model.test_moe import _rewrite

    def fuse(t: dict) -> None:
        p = "model.layers.1"
        e = [f"{p}.block_sparse_moe.experts.{i}" for i in range(experts)]
        t[f"{p}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{x}.w1.weight"), t.pop(f"{x}.w3.weight")])
                                                          for x in e])
        t[f"{p}.mlp.experts.down_proj"] = torch.stack([t.pop(f"{x}.w2.weight") for x in e])
        t[f"{p}.mlp.gate.weight"] = t.pop(f"{p}.block_sparse_moe.gate.weight")

    _rewrite(path, fuse)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "mixtral", "mixtral-stacked", "qwen3_moe"])
def test_two_ranks_answer_as_one(tmp_path, default_model, name):
    arch, kw = ARCHS[name.removesuffix("-stacked")]
    path = make_tiny_model(tmp_path / name, arch, default_model, **kw)
    if name.endswith("-stacked"):
        _fuse_experts(path, kw["num_local_experts"])
    with LLM(str(path), **ENGINE) as llm:
        one = run(llm)
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        two = run(llm)
        s = llm.wait_idle()
        llm.check()
    assert_same(two, one)
    assert s.running == 0 and s.pages_used == s.pages_cached
