"""Tensor parallelism over 2 ranks of tiny random Gemma 2, Gemma 3, Phi-3, SmolLM3, Granite,
Command R7B (Cohere2), Mixtral, Qwen3-MoE, Qwen2-MoE, GLM-4.5 and Granite MoE models on gloo:
the answers of one rank (greedy tokens, prompt logprobs within 1e-4) on the workload of
tests/distributed/workload.py (a cached prefix, chunked prefill, preemption). Gemma's
extra norms, scaled embedding, capped scores and logits and sliding windows, and Phi-3's
fused checkpoint tensors (read by each rank as the slices of their q, k, v and gate, up
parts), and experts split over their intermediate size (Mixtral's per-expert w1/w3/w2,
Qwen3-MoE's dense first layer beside sparse ones, Qwen2-MoE's shared expert split as a
dense MLP) are what these add to the Llama family's tests."""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, run
from tests.model.test_architectures import ARCHS as DENSE
from tests.model.test_architectures import perturb_norms
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


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "smollm3", "granite", "cohere2", "cohere_qk",
                                  "llama_mlp_bias", "mixtral", "mixtral-stacked", "qwen3_moe", "qwen2_moe", "glm4_moe",
                                  "granite_moe"])
def test_two_ranks_answer_as_one(tmp_path, default_model, name):
    arch, kw = ARCHS[name.removesuffix("-stacked")]
    path = make_tiny_model(tmp_path / name, arch, default_model, **kw)
    if name == "cohere_qk":  # (each rank's rows of the per-head q/k norm weights: all 1 as initialised)
        perturb_norms(path)
    if name == "llama_mlp_bias":  # (each rank's gate/up biases, rank 0's down bias: all 0 as initialised)
        perturb_norms(path, "mlp")
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


def test_float8_rows_split_over_ranks_take_the_scales_of_whole_rows(tmp_path, default_model):
    """--quantization fp8 with 2 ranks: a row-parallel layer's rows (o_proj, the experts'
    down_proj) are split over the ranks, and each row's scale is its whole row's max (an
    all-reduce at load), so rank 0's float8 weights and scales are exactly one rank's."""
    arch, kw = ARCHS["mixtral"]
    path = make_tiny_model(tmp_path / "mixtral", arch, default_model, **kw)
    with LLM(str(path), quantization="fp8") as llm:
        layer = llm.engine.runner.model.layers[1]
        o, moe = layer.self_attn.o_proj, layer.mlp.experts
        want = [o.weight[:, : o.in_features // 2].float(), o.weight_scale.clone(),
                moe.down_proj[:, :, : moe.down_proj.shape[2] // 2].float(), moe.down_proj_scale.clone()]
    with LLM(str(path), quantization="fp8", tensor_parallel_size=2) as llm:
        layer = llm.engine.runner.model.layers[1]
        o, moe = layer.self_attn.o_proj, layer.mlp.experts
        got = [o.weight.float(), o.weight_scale, moe.down_proj.float(), moe.down_proj_scale]
    for name, a, b in zip(["o_proj", "its scales", "experts' down_proj", "their scales"], got, want):
        assert a.shape == b.shape and torch.equal(a, b), name


def test_float8_answers_of_two_ranks_stay_within_the_error_of_float8_itself(tmp_path, default_model):
    """The activations entering a row-parallel layer are quantized per token on each rank's
    slice of the row (as vLLM's per-token scales are), so two ranks' answers are not one
    rank's bit for bit: their prompt logprobs stay closer to one rank's float8 answers than
    those are to the unquantized model's."""
    path = make_tiny_model(tmp_path / "llama", "LlamaForCausalLM", default_model, initializer_range=0.05)
    prompts = [[5, 17, 99, 5, 17, 300, 41] * 3, list(range(100, 140))]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1)
    lps = {}
    for name, kw in [("full", {}), ("one", {"quantization": "fp8"}),
                     ("two", {"quantization": "fp8", "tensor_parallel_size": 2})]:
        with LLM(str(path), **kw) as llm:
            lps[name] = [o.prompt_logprobs for o in llm.generate(prompts, params)]

    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for p, q in zip(lps[a], lps[b]) for x, y in zip(p, q))

    assert 0 < gap("two", "one") < gap("one", "full") < 0.1
