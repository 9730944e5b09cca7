"""Int4 experts (issue 30's models from AWQ, GPTQ and compressed-tensors checkpoints): each expert's
projections, one tensor each in these checkpoints, are repacked into one stacked layout
(model/moe.py Experts.expect_int4) and run through kernels/moe_int4.py's semantics, so the model
generates as transformers does on the checkpoint's dequantized weights. The checkpoints are written
by tests/model/test_int4_checkpoint.py's packers (independent of the loaders)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kernels.int4 import dequantize
from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from streamer.model.int4_linear import Int4Linear
from streamer.model.loader import load_model
from tests.conftest import make_tiny_model
from tests.model.test_int4_checkpoint import generates_as, qconfig, quantize_checkpoint

SHAPES = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              initializer_range=0.05, num_hidden_layers=2)
ARCHS = {
    "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                intermediate_size=96, norm_topk_prob=True),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                intermediate_size=96, shared_expert_intermediate_size=96),
    "OlmoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64),
}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny_moe(request, tmp_path_factory) -> Path:
    arch = request.param
    return make_tiny_model(tmp_path_factory.mktemp("int4moe") / arch, arch, None, **SHAPES, **ARCHS[arch])


def hf_on(src: Path, deq: dict[str, torch.Tensor]):
    """transformers' model of src with the dequantized weights; its experts are stacked in memory
    (experts.gate_up_proj [E, 2I, H]: gate rows then up rows; experts.down_proj [E, H, I])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in deq.items():
            m = EXPERT.fullmatch(name)
            if m is None:
                params[name].copy_(w)
                continue
            experts = f"model.layers.{m[1]}.mlp.experts"
            e, which = int(m[2]), m[3]
            if which in ("down_proj", "w2"):
                params[f"{experts}.down_proj"][e].copy_(w)
            else:
                rows = params[f"{experts}.gate_up_proj"][e]
                half = rows.shape[0] // 2
                rows[(0 if which in ("gate_proj", "w1") else half):][:half].copy_(w)
    return model


VARIANTS = [("awq", 32, False, False), ("gptq", 32, False, False), ("gptq", 32, False, True), ("ct", 32, False, False),
            ("ct", 32, False, True), ("ct", None, True, False)]


@pytest.mark.parametrize("fmt,group,sym,desc_act", VARIANTS,
                         ids=["awq", "gptq", "gptq-desc_act", "ct-asym", "ct-actorder", "ct-channel-sym"])
def test_int4_experts_run_as_transformers_on_their_dequantized_weights(tiny_moe, tmp_path, fmt, group, sym, desc_act):
    """(desc_act / actorder "group": each expert's own order of its inputs, gate and up sharing theirs.)"""
    path, deq = quantize_checkpoint(tiny_moe, tmp_path / fmt, fmt, group, desc_act, sym)
    assert any(EXPERT.fullmatch(n) for n in deq)  # (the experts are int4 in the file)
    model, _ = load_model(path)
    ex = model.layers[0].mlp.experts
    assert ex.int4 is not None and ex.gate_up_proj.dtype == torch.int32
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)
    # the stacked layout holds each expert's projections as the packer wrote them (gate, up, down)
    names = type(model).expert_names
    block = type(model).legacy_block
    assert (ex.int4_perms is not None) == desc_act
    for e in range(ex.gate_up_proj.shape[0]):
        g1, g2 = ex.int4_groups
        gu = dequantize(ex.gate_up_proj[e], ex.gate_up_proj_scale[e], ex.gate_up_proj_zero[e], g1, torch.float32)
        dn = dequantize(ex.down_proj[e], ex.down_proj_scale[e], ex.down_proj_zero[e], g2, torch.float32)
        if desc_act:  # (stored column k is input column perm[k])
            gu, dn = (w[:, torch.argsort(p[e].long())] for w, p in zip((gu, dn), ex.int4_perms, strict=True))
        want = [deq[f"model.layers.0.{block}.experts.{e}.{n}.weight"] for n in names]
        torch.testing.assert_close(gu, torch.cat(want[:2]), rtol=0, atol=0)
        torch.testing.assert_close(dn, want[2], rtol=0, atol=0)
    generates_as(path, hf_on(tiny_moe, deq), 8)


def test_gate_and_up_orders_that_differ_are_refused(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = quantize_checkpoint(tiny_moe, tmp_path / "g", "gptq", 32, desc_act=True)
    tensors = load_file(str(path / "model.safetensors"))
    name = next(n for n in tensors if re.search(r"experts\.1\.(up_proj|w3)\.g_idx$", n))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="g_idx' differs from the g_idx of the other parts"):
        load_model(path)


def test_int4_experts_of_an_architecture_that_stacks_them_are_refused(tmp_path):
    moe = make_tiny_model(tmp_path / "moe", "GraniteMoeForCausalLM", None, num_local_experts=4, num_experts_per_tok=2,
                          intermediate_size=64)
    cfg = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**cfg, "quantization_config": qconfig("gptq", 32)}))
    with pytest.raises(ModelLoadError, match="experts of GraniteMoeForCausalLM to int4 .*this architecture are not"):
        load_model(moe)


def test_a_missing_expert_scale_is_named(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = quantize_checkpoint(tiny_moe, tmp_path / "a", "awq", 32)
    tensors = load_file(str(path / "model.safetensors"))
    gone = next(n for n in tensors if EXPERT.fullmatch(n.replace(".scales", ".weight")) and n.endswith(".scales"))
    del tensors[gone]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(gone.removeprefix("model.").rsplit(".", 1)[0])):
        load_model(path)


def test_dummy_int4_experts(tiny_moe, tmp_path):
    """load_format "dummy" (benchmarks) fills int4 experts with valid values: zeros 8, small scales."""
    path, _ = quantize_checkpoint(tiny_moe, tmp_path / "d", "gptq", 32)
    model, _ = load_model(path, load_format="dummy")
    ex = model.layers[1].mlp.experts
    assert bool((ex.down_proj_zero == 8).all()) and bool((ex.gate_up_proj_scale == 0.005).all())
    with LLM(str(path), dtype="float32", device="cpu", load_format="dummy") as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 3


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("fmt,desc_act", [("awq", False), ("gptq", True)], ids=["awq", "gptq-desc_act"])
def test_deepseek_int4(tmp_path, default_model, arch, fmt, desc_act):
    """DeepSeek's latent attention and experts from an int4 checkpoint: q (or q_a/q_b) and
    kv_a_proj_with_mqa int4 layers whose rope rows are de-interleaved after loading (their rows
    permuted with them), kv_b_proj dequantized once loaded (absorbed attention reads it as
    matrices), int4 routed experts beside int4 shared experts; transformers on the dequantized
    weights is the oracle. (Groups of 16: o_proj's K is 4 heads x 12 value dims.)"""
    from tests.model.test_deepseek import CONFIGS

    cfg = {**CONFIGS[arch], **({"q_lora_rank": 32} if arch == "DeepseekV3ForCausalLM" else {})}
    src = make_tiny_model(tmp_path / "src", arch, default_model, **cfg)
    path, deq = quantize_checkpoint(src, tmp_path / fmt, fmt, 16, desc_act)
    model, _ = load_model(path)
    attn = model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, Int4Linear) and type(attn.kv_b_proj).__name__ == "LatentProjection"
    torch.testing.assert_close(attn.kv_b_proj.weight, deq["model.layers.0.self_attn.kv_b_proj.weight"],
                               rtol=0, atol=0)
    assert model.layers[-1].mlp.experts.int4 is not None
    generates_as(path, hf_on(src, deq), 8)


@pytest.mark.parametrize("fmt,desc_act", [("awq", False), ("gptq", True)], ids=["awq", "gptq-desc_act"])
def test_glm4_moe_int4(tmp_path, fmt, desc_act):
    """GLM-4.5 from an int4 checkpoint: a dense first layer, q/k/v biases beside int4 weights, q/k
    norms on half-rotary heads, grouped routing with a correction bias, and int4 routed experts
    beside an int4 shared expert."""
    from tests.model.test_deepseek import perturb

    src = make_tiny_model(tmp_path / "glm", "Glm4MoeForCausalLM", None, **SHAPES, n_routed_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=96, n_shared_experts=1,
                          n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                          routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                          pad_token_id=None)
    perturb(src)  # (biases, norms and the correction bias away from their initial values)
    path, deq = quantize_checkpoint(src, tmp_path / fmt, fmt, 32, desc_act)
    model, _ = load_model(path)
    assert model.layers[0].mlp.__class__.__name__ != model.layers[1].mlp.__class__.__name__  # (dense, then MoE)
    moe = model.layers[1].mlp
    assert moe.experts.int4 is not None and isinstance(moe.shared_experts.gate_up_proj, Int4Linear)
    generates_as(path, hf_on(src, deq), 8)
