"""Quantized checkpoints under tensor parallelism (gloo, CPU): each rank reads its part of a
float8 checkpoint's scales (per tensor, per row, per [128, 128] block) and of an int4
checkpoint's packed words, scales, zeros and group indices (AWQ, GPTQ, compressed-tensors). Int4
(weight-only): two ranks answer as one, the same greedy tokens, logprobs within 1e-4 (float32).
Float8: rank 0's weights and scales stand for exactly its part of one rank's layers, and the
answers stay within float8's own error (each rank quantizes its part of a row-parallel layer's
input per token). A part that would start inside a block or a group, or an act order that mixes
the ranks' columns, is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from tests.conftest import make_tiny_model
from tests.model import test_fp8_checkpoint as F8
from tests.model import test_int4_checkpoint as I4
from tests.model.test_moe import moe_models  # noqa: F401 - the fixture

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def answers(path: Path, **kw) -> list[tuple[list[int], list[float]]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 29, 70)]
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, **kw) as llm:
        outs = llm.generate(prompts, PARAMS)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in outs]


def assert_two_ranks_answer_as_one(path: Path) -> None:
    one, two = answers(path), answers(path, tensor_parallel_size=2)
    for (t1, l1), (t2, l2) in zip(one, two, strict=True):
        assert t2 == t1
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-4


@pytest.fixture(scope="module")
def int4_tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tpint4") / "llama", "LlamaForCausalLM", None, **I4.SHAPES)


@pytest.mark.parametrize("fmt,group,sym", [("awq", 32, False), ("gptq", 32, False), ("gptq", 32, True),
                                           ("ct", 32, False), ("ct", 32, True), ("ct", None, True)],
                         ids=["awq", "gptq", "gptq-sym", "ct-asym", "ct-sym", "ct-channel"])
def test_int4_checkpoints(int4_tiny, tmp_path, fmt, group, sym):
    path, _ = I4.quantize_checkpoint(int4_tiny, tmp_path / fmt, fmt, group, sym=sym)
    assert_two_ranks_answer_as_one(path)


def test_int4_act_order_that_mixes_the_ranks_columns_is_refused(int4_tiny, tmp_path):
    """(GPTQ desc_act: a random order of K. Column-parallel layers take g_idx whole; o and down
    split K, and their groups hold columns of both halves.)"""
    path, _ = I4.quantize_checkpoint(int4_tiny, tmp_path / "desc", "gptq", 32, desc_act=True)
    with pytest.raises(ModelLoadError, match="act order .* cannot be split"):
        LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2)


def test_int4_groups_a_rank_would_cut_are_refused(int4_tiny, tmp_path):
    """down_proj's 192 input columns split 96 + 96: groups of 64 would be cut."""
    path, _ = I4.quantize_checkpoint(int4_tiny, tmp_path / "g64", "awq", 64)
    with pytest.raises(ModelLoadError, match=r"\(128, 96\) \(this rank's part under tensor_parallel_size=2\) with "
                                             "group_size 64"):
        LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tpfp8") / "llama", "LlamaForCausalLM", None, **F8.SHAPES)


def dequantized(m) -> torch.Tensor:
    """A float8 layer's weight in float32: its float8 values times their row or block scales."""
    w = m.weight.float()
    s = m.weight_scale.float()
    if m.block is not None:
        bn, bk = m.block
        s = s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
        return w * s
    return w * s.reshape(-1, 1)


def rank0_parts(w: torch.Tensor, parts: list[int], axis: int) -> torch.Tensor:
    """Rank 0's part of one rank's weight: the first half of each fused part's rows (axis 0),
    or the first half of the columns (axis 1)."""
    if axis == 1:
        return w[:, : w.shape[1] // 2]
    out, at = [], 0
    for n in parts:
        out.append(w[at : at + n // 2])
        at += n
    return torch.cat(out)


PROMPTS = [[5, 17, 99, 5, 17, 300, 41] * 3, list(range(100, 140))]


def prompt_logprobs(llm: LLM) -> list[list[float]]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1)
    return [o.prompt_logprobs for o in llm.generate(PROMPTS, params)]


def assert_within_float8_error(lps: dict[str, list[list[float]]], original: Path) -> None:
    """The answers of two ranks (lps["two"]) are closer to one rank's (lps["one"]) than one
    rank's are to the unquantized model's: within the error of float8 itself."""
    with LLM(str(original), dtype="float32", device="cpu") as llm:
        lps = dict(lps, full=prompt_logprobs(llm))

    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for p, r in zip(lps[a], lps[b]) for x, y in zip(p, r))

    assert gap("two", "one") < gap("one", "full")


def assert_rank0_holds_its_part(path: Path, original: Path) -> None:
    """Rank 0's float8 weights and scales stand for exactly its part of one rank's layers; the
    answers of two ranks stay within the error of float8 itself (the activations entering a
    row-parallel layer are quantized per token on each rank's part of the row: as vLLM's).
    (One engine of each size answers both.)"""
    layers, lps = {}, {}
    for n, label in ((1, "one"), (2, "two")):
        with LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=n) as llm:
            layer = llm.engine.runner.model.layers[0]
            attn, mlp = layer.self_attn, layer.mlp
            layers[n] = {name: dequantized(m) for name, m in [("qkv", attn.qkv_proj), ("o", attn.o_proj),
                                                               ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)]}
            lps[label] = prompt_logprobs(llm)
    cfg = F8.SHAPES
    q, kv, inter = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"], \
        cfg["intermediate_size"]
    for name, parts, axis in [("qkv", [q, kv, kv], 0), ("o", [], 1), ("gate_up", [inter, inter], 0),
                              ("down", [], 1)]:
        assert torch.equal(layers[2][name], rank0_parts(layers[1][name], parts, axis)), name
    assert_within_float8_error(lps, original)


@pytest.mark.parametrize("kind", ["per-tensor", "per-channel"])
def test_float8_checkpoints(fp8_tiny, tmp_path, kind):
    if kind == "per-tensor":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        path = F8.write_checkpoint(fp8_tiny, tmp_path / "t", qc, F8.per_tensor, "weight_scale_inv")
    else:
        qc = F8.ct_config({"strategy": "channel"}, {"num_bits": 8, "type": "float", "strategy": "token",
                                                    "dynamic": True, "symmetric": True})
        path = F8.write_checkpoint(fp8_tiny, tmp_path / "c", qc, F8.per_row, "weight_scale")
    assert_rank0_holds_its_part(path, fp8_tiny)


def test_block_scaled_float8_checkpoint(tmp_path, monkeypatch):
    """[128, 128] blocks: heads of 128 dims, so that every rank's part starts on a block."""
    shapes = dict(F8.SHAPES, head_dim=128)
    monkeypatch.setattr(F8, "SHAPES", shapes)
    tiny = make_tiny_model(tmp_path / "llama", "LlamaForCausalLM", None, **shapes)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = F8.write_checkpoint(tiny, tmp_path / "b", qc, F8.block_128, "weight_scale_inv")
    assert_rank0_holds_its_part(path, tiny)


def test_a_float8_block_a_rank_would_cut_is_refused(fp8_tiny, tmp_path):
    """Heads of 64 dims: the second rank's k_proj rows start inside a block of 128."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = F8.write_checkpoint(fp8_tiny, tmp_path / "b", qc, F8.block_128, "weight_scale_inv")
    with pytest.raises(ModelLoadError, match="do not fall on whole weight blocks of 128"):
        LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2)


def test_float8_experts_per_channel(moe_models, tmp_path):  # noqa: F811
    """Qwen3-MoE with per-channel float8 experts (compressed-tensors): rank 0 holds the first half
    of every expert's gate and up rows with their scales, and the first half of its down
    projection's columns with the whole rows' scales; the answers stay within float8's error."""
    from tests.model.test_moe_fp8_checkpoint import channel_config, write

    path = write(moe_models["qwen3_moe"], tmp_path / "moe", channel_config(), F8.per_row, "weight_scale")
    experts, lps = {}, {}
    for n, label in ((1, "one"), (2, "two")):
        with LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=n) as llm:
            ex = llm.engine.runner.model.layers[1].mlp.experts
            experts[n] = {p: getattr(ex, p).float().clone() for p in
                          ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale")}
            lps[label] = prompt_logprobs(llm)
    one, two = experts[1], experts[2]
    inter = one["down_proj"].shape[2]
    half = inter // 2
    for p in ("gate_up_proj", "gate_up_proj_scale"):
        assert torch.equal(two[p], torch.cat([one[p][:, :half], one[p][:, inter : inter + half]], dim=1)), p
    assert torch.equal(two["down_proj"], one["down_proj"][:, :, :half])
    assert torch.equal(two["down_proj_scale"], one["down_proj_scale"])
    assert_within_float8_error(lps, moe_models["qwen3_moe"])


@pytest.mark.parametrize("fmt,group,sym", [("awq", 32, False), ("gptq", 32, False), ("ct", None, True)],
                         ids=["awq", "gptq", "ct-channel"])
def test_int4_experts(tmp_path, fmt, group, sym):
    """Qwen3-MoE with int4 experts (model/experts.py): each rank reads its half of every expert's gate
    and up rows and of its down projection's columns, in each format's packed layout (words, scales,
    zeros, g_idx): two ranks answer as one. (ct-channel: one scale per row, so the down projection's
    group is the rank's half of the row.)"""
    from tests.model.test_int4_moe import ARCHS, SHAPES

    src = make_tiny_model(tmp_path / "src", "Qwen3MoeForCausalLM", None, **SHAPES, **ARCHS["Qwen3MoeForCausalLM"])
    path, _ = I4.quantize_checkpoint(src, tmp_path / fmt, fmt, group, sym=sym)
    assert_two_ranks_answer_as_one(path)


@pytest.mark.parametrize("arch,fmt", [("MixtralForCausalLM", "awq"), ("Qwen2MoeForCausalLM", "gptq")])
def test_int4_experts_of_other_families(tmp_path, arch, fmt):
    """Mixtral's w1/w3/w2 experts, Qwen2-MoE's experts beside its int4 shared expert (and the shared
    expert's gate), each rank holding half of every intermediate size. (A shared expert of 96 would
    leave each rank 48 columns, not whole groups of 32: refused by name, as the second case shows.)"""
    from tests.model.test_int4_moe import ARCHS, SHAPES

    shapes = {**SHAPES, **ARCHS[arch], **({"shared_expert_intermediate_size": 128} if "Qwen2" in arch else {})}
    src = make_tiny_model(tmp_path / "src", arch, None, **shapes)
    path, _ = I4.quantize_checkpoint(src, tmp_path / fmt, fmt, 32)
    assert_two_ranks_answer_as_one(path)
    if "Qwen2" in arch:
        narrow = make_tiny_model(tmp_path / "narrow", arch, None, **SHAPES, **ARCHS[arch])
        path, _ = I4.quantize_checkpoint(narrow, tmp_path / "narrow-q", fmt, 32)
        with pytest.raises(ModelLoadError, match=r"shared_expert\.down_proj of shape \(128, 48\) \(this rank's part"):
            answers(path, tensor_parallel_size=2)

@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_int4_deepseek(tmp_path, default_model, arch):
    """DeepSeek from a GPTQ checkpoint on two ranks: each rank's heads of the int4 q (or q_b) and
    o projections, the whole int4 latent projection (its rope rows de-interleaved on each rank),
    its heads of the dequantized kv_b_proj, and half of every int4 expert's intermediate size. (v_head_dim 16:
    a rank's o_proj columns, 2 heads x 16, must hold whole groups of 16.)"""
    from tests.model.test_deepseek import CONFIGS

    cfg = {**CONFIGS[arch], "v_head_dim": 16, **({"q_lora_rank": 32} if arch == "DeepseekV3ForCausalLM" else {})}
    src = make_tiny_model(tmp_path / "src", arch, default_model, **cfg)
    path, _ = I4.quantize_checkpoint(src, tmp_path / "gptq", "gptq", 16)
    assert_two_ranks_answer_as_one(path)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_layers_with_biases(tmp_path, fmt):
    """Qwen2's q/k/v biases beside int4 weights: each rank takes its heads' rows of the bias, not a
    packed tensor's share (which cut them before)."""
    from safetensors.torch import load_file, save_file

    tiny = make_tiny_model(tmp_path / "qwen2", "Qwen2ForCausalLM", None, **I4.SHAPES)
    tensors = load_file(str(tiny / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    tensors = {n: torch.randn(t.shape, generator=g) * 0.3 if n.endswith("bias") else t for n, t in tensors.items()}
    save_file(tensors, str(tiny / "model.safetensors"))
    path, _ = I4.quantize_checkpoint(tiny, tmp_path / fmt, fmt, 32)
    assert_two_ranks_answer_as_one(path)
