"""Float8 checkpoints of mixtures of experts load as stored: every expert projection's
float8 weight and its per-channel or per-tensor scale become the float8 experts'
per-row scales (fused_moe's float8 path, inputs quantized per token). A checkpoint of
the per-row scales quantization "fp8" computes online runs exactly as the online one.
Block-scaled experts are dequantized as they load, so they run as transformers runs the
dequantized checkpoint. Per-tensor input scales, partly quantized layers, missing scales
and unquantized tensors where float8 ones belong are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from streamer.model.loader import load_model
from tests.model.test_fp8_checkpoint import ct_config, generate, per_row, per_tensor
from tests.model.test_greedy_vs_transformers import assert_matches, run_and_compare
from tests.model.test_greedy_vs_transformers import prompts as text_prompts
from tests.model.test_moe import ARCHS, moe_models  # noqa: F401 - the fixture

FP8 = torch.float8_e4m3fn
TOKEN_ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
PARAMS_GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
ROUTER = ("mlp.gate.weight", "block_sparse_moe.gate.weight")  # routers stay in the model's dtype


def quantized(name: str, t: torch.Tensor) -> bool:
    return (name.endswith(".weight") and t.dim() == 2 and not any(k in name for k in ("lm_head", "embed_tokens"))
            and not name.endswith(ROUTER))


def write(src: Path, dst: Path, qconfig: dict, quantize, scale_name: str, edit=None, which=quantized) -> Path:
    """src's model with the weights `which` selects replaced by quantize(W) = (float8, scale)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if which(name, t):
            out[name], out[name.removesuffix("weight") + scale_name] = quantize(t)
        else:
            out[name] = t
    if edit is not None:
        edit(out)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qconfig}))
    return dst


def channel_config() -> dict:
    return ct_config({"strategy": "channel"}, TOKEN_ACTS, ignore=("lm_head", r"re:.*\.gate$"))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_per_channel_experts_run_as_online_fp8_does(moe_models, tmp_path, name):  # noqa: F811
    """compressed-tensors per-channel weights with per-token inputs: the same float8 experts
    and scales in memory as quantization "fp8" makes, so the same tokens and logprobs."""
    path = write(moe_models[name], tmp_path / name, channel_config(), per_row, "weight_scale")
    stored, _ = load_model(path)
    online, _ = load_model(moe_models[name], quantization="fp8")
    ex, want = stored.layers[1].mlp.experts, online.layers[1].mlp.experts
    assert ex.gate_up_proj.dtype == FP8 and ex.down_proj.dtype == FP8
    for p in ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale"):
        assert torch.equal(getattr(ex, p), getattr(want, p)), p
    assert stored.layers[1].mlp.gate.weight.dtype == torch.float32
    ours, theirs = generate(path), generate(moe_models[name], quantization="fp8")
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor([t.logprob for t in a.logprobs]),
                                   torch.tensor([t.logprob for t in b.logprobs]), rtol=0, atol=1e-6)


def test_per_tensor_scales_fill_their_experts_rows(moe_models, tmp_path):  # noqa: F811
    """transformers' "fp8" format without blocks (one weight_scale_inv per tensor), Mixtral's
    w1 (gate) / w3 (up) / w2 (down): each expert's scale fills its own rows."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["gate"]}
    scalar = lambda w: (lambda q, s: (q, s.reshape(())))(*per_tensor(w))  # noqa: E731
    path = write(moe_models["mixtral"], tmp_path / "mixtral", qconfig, scalar, "weight_scale_inv")
    tensors = load_file(str(path / "model.safetensors"))
    model, _ = load_model(path)
    ex = model.layers[0].mlp.experts
    inter = ex.down_proj.shape[2]
    for e in range(ex.down_proj.shape[0]):
        stored = {w: tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight_scale_inv"] for w in
                  ("w1", "w3", "w2")}
        assert torch.equal(ex.gate_up_proj_scale[e, :inter], stored["w1"].expand(inter))
        assert torch.equal(ex.gate_up_proj_scale[e, inter:], stored["w3"].expand(inter))
        assert torch.equal(ex.down_proj_scale[e], stored["w2"].expand(ex.down_proj.shape[1]))
        assert torch.equal(ex.gate_up_proj[e, inter:].view(torch.uint8),
                           tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"].view(torch.uint8))
    assert stored["w1"] != stored["w3"]
    outs = generate(path)
    assert all(torch.isfinite(torch.tensor([t.logprob for t in o.logprobs])).all() for o in outs)


def test_dummy_weights_of_a_float8_moe_checkpoint(moe_models, tmp_path):  # noqa: F811
    folder = write(moe_models["qwen3_moe"], tmp_path / "q", channel_config(), per_row, "weight_scale")
    model, _ = load_model(folder, load_format="dummy")
    ex = model.layers[1].mlp.experts
    assert ex.gate_up_proj.dtype == FP8 and torch.isfinite(ex.gate_up_proj_scale).all()


def _refused(path: Path, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def blocks_32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block scales ([32, 32] blocks here: the tiny experts are 32 x 64), W = q * s."""
    n, k = w.shape
    s = w.abs().reshape(n // 32, 32, k // 32, 32).amax(dim=(1, 3)) / 448.0
    return (w / s.repeat_interleave(32, 0).repeat_interleave(32, 1)).clamp(-448, 448).to(FP8), s


def test_block_scaled_experts_run_as_transformers_runs_them_dequantized(moe_models, tmp_path):  # noqa: F811
    """Only the experts block-scaled (quant_method "fp8", weight_block_size [32, 32]): each
    projection is dequantized as its weight and scale come in, so the model holds the fp32
    weights the checkpoint stands for, and greedy output equals transformers' generate over
    those weights saved as a plain checkpoint."""
    src = moe_models["qwen3_moe"]
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
               "modules_to_not_convert": [r".*self_attn", r"model\.layers\.0\.mlp", "mlp.gate", "lm_head"]}
    path = write(src, tmp_path / "blocks", qconfig, blocks_32, "weight_scale_inv",
                 which=lambda n, t: quantized(n, t) and ".experts." in n)
    stored = load_file(str(path / "model.safetensors"))
    plain = {n: t for n, t in stored.items() if not n.endswith("weight_scale_inv")}
    for n, t in plain.items():
        if t.dtype == FP8:
            plain[n] = t.float() * stored[n + "_scale_inv"].repeat_interleave(32, 0).repeat_interleave(32, 1)
    dequantized = shutil.copytree(src, tmp_path / "dequantized")
    save_file(plain, str(dequantized / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))

    model, _ = load_model(path)
    ex = model.layers[1].mlp.experts
    assert ex.gate_up_proj.dtype == torch.float32 and ex.gate_up_proj_scale is None and not ex.pending
    assert torch.equal(ex.down_proj[3], plain["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert torch.equal(ex.gate_up_proj[5, 32:], plain["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert not torch.equal(ex.down_proj[3], original["model.layers.1.mlp.experts.3.down_proj.weight"])
    with LLM(str(path)) as llm:
        batch = text_prompts(llm.tokenizer, 3, 20, 70, seed=5)
        assert_matches(run_and_compare(llm, dequantized, batch, PARAMS_GREEDY), 3)


def test_a_block_scaled_expert_without_its_scale_is_named(moe_models, tmp_path):  # noqa: F811
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight_scale_inv"
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
               "modules_to_not_convert": ["gate", "lm_head"]}
    path = write(moe_models["mixtral"], tmp_path / "m", qconfig, blocks_32, "weight_scale_inv",
                 edit=lambda t: t.pop(name))
    _refused(path, "missing tensor", "layers.0.block_sparse_moe.experts.1.w2.weight_scale")


def test_per_tensor_input_scales_of_experts_are_refused(moe_models, tmp_path):  # noqa: F811
    qconfig = ct_config({"strategy": "channel"}, {**TOKEN_ACTS, "strategy": "tensor"},
                        ignore=("lm_head", r"re:.*\.gate$"))
    _refused(write(moe_models["qwen3_moe"], tmp_path / "q", qconfig, per_row, "weight_scale"),
             "quantizes the inputs of model.layers.1.mlp.experts per tensor")


def test_a_partly_quantized_layer_of_experts_is_refused(moe_models, tmp_path):  # noqa: F811
    qconfig = ct_config({"strategy": "channel"}, TOKEN_ACTS,
                        ignore=("lm_head", r"re:.*\.gate$", "model.layers.1.mlp.experts.3.up_proj"))
    _refused(write(moe_models["qwen3_moe"], tmp_path / "q", qconfig, per_row, "weight_scale"),
             "some of the projections of model.layers.1.mlp.experts")


def test_a_missing_expert_scale_is_named(moe_models, tmp_path):  # noqa: F811
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale"
    path = write(moe_models["qwen3_moe"], tmp_path / "q", channel_config(), per_row, "weight_scale",
                 edit=lambda t: t.pop(name))
    _refused(path, "missing tensor", name.removeprefix("model."))


def test_an_unquantized_expert_where_float8_belongs_is_refused(moe_models, tmp_path):  # noqa: F811
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    src = load_file(str(moe_models["qwen3_moe"] / "model.safetensors"))
    path = write(moe_models["qwen3_moe"], tmp_path / "q", channel_config(), per_row, "weight_scale",
                 edit=lambda t: t.update({name: src[name]}))
    _refused(path, name, "torch.float32", "float8")


def test_a_misshapen_expert_scale_is_refused(moe_models, tmp_path):  # noqa: F811
    name = "model.layers.1.mlp.experts.0.up_proj.weight_scale"
    path = write(moe_models["qwen3_moe"], tmp_path / "q", channel_config(), per_row, "weight_scale",
                 edit=lambda t: t.update({name: t[name][:-1].contiguous()}))
    _refused(path, name, "per-channel scale")


def test_glms_float8_checkpoint_with_its_prediction_layer_loads(moe_models, tmp_path):  # noqa: F811
    """GLM-4.5-FP8: block-scaled float8 throughout, the router kept, and a multi-token-
    prediction layer past num_hidden_layers whose float8 tensors and scales are skipped
    before the float8 checks read them (transformers ignores that layer)."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
               "modules_to_not_convert": ["mlp.gate", "lm_head"]}

    def add_prediction_layer(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.eh_proj.weight"], t["model.layers.2.eh_proj.weight_scale_inv"] = blocks_32(torch.randn(64, 128))

    path = write(moe_models["glm4_moe"], tmp_path / "glm", qconfig, blocks_32, "weight_scale_inv",
                 edit=add_prediction_layer)
    model, _ = load_model(path)
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == FP8 and len(model.layers) == 2
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
