"""Float8 checkpoints of mixtures of experts load as stored: every expert projection's
float8 weight and its per-channel or per-tensor scale become the float8 experts'
per-row scales (fused_moe's float8 path, inputs quantized per token). A checkpoint of
the per-row scales quantization "fp8" computes online runs exactly as the online one.
Block-scaled experts load as stored (float8, each projection's block grid) and run as
transformers runs the dequantized checkpoint with the experts' inputs rounded per token and
group of bk columns. Per-tensor input scales, partly quantized layers, missing or misshapen
scales and unquantized tensors where float8 ones belong are refused by name."""

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
from tests.model.test_greedy_vs_transformers import assert_matches
from tests.model.test_greedy_vs_transformers import prompts as text_prompts
from tests.model.test_moe import ARCHS, moe_models  # noqa: F401 - the fixture
from tests.oracle import Comparison, compare

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


def block_checkpoint(src: Path, tmp_path: Path, edit=None) -> Path:
    """src (the tiny Qwen3-MoE) with only its experts block-scaled (quant_method "fp8", [32, 32])."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
               "modules_to_not_convert": [r".*self_attn", r"model\.layers\.0\.mlp", "mlp.gate", "lm_head"]}
    return write(src, tmp_path / "blocks", qconfig, blocks_32, "weight_scale_inv", edit=edit,
                 which=lambda n, t: quantized(n, t) and ".experts." in n)


def dequantized_blocks(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The fp32 weight a stored float8 weight and its [32, 32] block scales stand for."""
    return stored[name].float() * stored[name + "_scale_inv"].repeat_interleave(32, 0).repeat_interleave(32, 1)


def test_block_scaled_experts_load_as_stored_and_run_as_transformers_with_their_roundings(
        moe_models, tmp_path):  # noqa: F811
    """Each expert projection's float8 weight and block scales land as stored (the gate's and
    up's grids stacked: [E, 2, 2]), and greedy output equals transformers' generate over the
    dequantized weights saved as a plain checkpoint, the experts' inputs rounded per token and
    group of 32 columns as ours are (tests/oracle.py emulate_block_experts)."""
    src = moe_models["qwen3_moe"]
    path = block_checkpoint(moe_models["qwen3_moe"], tmp_path)
    stored = load_file(str(path / "model.safetensors"))
    plain = {n: dequantized_blocks(stored, n) if t.dtype == FP8 else t for n, t in stored.items()
             if not n.endswith("weight_scale_inv")}
    dequantized = shutil.copytree(src, tmp_path / "dequantized")
    save_file(plain, str(dequantized / "model.safetensors"))

    model, _ = load_model(path)
    ex = model.layers[1].mlp.experts
    assert ex.gate_up_proj.dtype == FP8 and ex.down_proj.dtype == FP8 and ex.block == (32, 32)
    assert ex.gate_up_proj_scale.shape == (8, 2, 2) and ex.down_proj_scale.shape == (8, 2, 1) and not ex.pending
    up = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert torch.equal(ex.gate_up_proj[5, 32:].view(torch.uint8), stored[up].view(torch.uint8))
    assert torch.equal(ex.gate_up_proj_scale[5, 1:], stored[up + "_scale_inv"])
    assert torch.equal(ex.down_proj_scale[3], stored["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"])
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    with LLM(str(path)) as llm:
        batch = text_prompts(llm.tokenizer, 3, 20, 70, seed=5)
        outs = llm.generate(batch, PARAMS_GREEDY)
    cmp = Comparison()
    for p, o in zip(batch, outs):
        assert o.error is None, o.error
        compare(dequantized, p, o.token_ids, cmp, expert_groups=32)
    assert_matches(cmp, 3)


def test_block_scaled_experts_compute_transformers_layer_with_the_roundings(moe_models, tmp_path):  # noqa: F811
    """One sparse layer given the same hidden states: ours (float8 experts, the reference's
    block formula) against transformers' experts over the dequantized weights with the inputs
    rounded per group, to float32 noise; without the roundings it is further off."""
    from tests.oracle import _hf_model, emulate_block_experts

    path = block_checkpoint(moe_models["qwen3_moe"], tmp_path)
    stored = load_file(str(path / "model.safetensors"))
    ours, _ = load_model(path)
    hf = _hf_model(str(moe_models["qwen3_moe"]))
    ex = hf.model.layers[1].mlp.experts
    for e in range(8):
        prefix = f"model.layers.1.mlp.experts.{e}."
        ex.gate_up_proj.data[e] = torch.cat([dequantized_blocks(stored, prefix + "gate_proj.weight"),
                                             dequantized_blocks(stored, prefix + "up_proj.weight")])
        ex.down_proj.data[e] = dequantized_blocks(stored, prefix + "down_proj.weight")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unrounded = hf.model.layers[1].mlp(x[None])[0]
        emulate_block_experts(hf, 32)
        want = hf.model.layers[1].mlp(x[None])[0]
        got = ours.layers[1].mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got - unrounded).abs().max() > 100 * (got - want).abs().max()


def test_a_block_scaled_expert_scale_of_the_wrong_grid_is_refused(moe_models, tmp_path):  # noqa: F811
    name = "model.layers.1.mlp.experts.4.gate_proj.weight_scale_inv"
    path = block_checkpoint(moe_models["qwen3_moe"], tmp_path,
                            edit=lambda t: t.update({name: t[name][:, :1].contiguous()}))
    _refused(path, name.removesuffix("_inv"), "(1, 1)", "block scales of this projection", "(1, 2)")


def test_on_cuda_a_bk_no_kernel_tile_divides_is_dequantized_at_load(moe_models, tmp_path):  # noqa: F811
    """bk 8: the MoE kernels' K tile divides bk and a tl.dot's is at least 16, so on CUDA these
    experts are dequantized into the model's dtype as each projection's weight and scale come
    in (prepared for a CUDA device here, loaded on CPU tensors); elsewhere they stay float8."""
    from types import SimpleNamespace

    from streamer.model import fp8_checkpoint, fp8_config
    from streamer.model.loader import iter_safetensors
    from tests.kernels.test_moe_block_fp8 import block_quantize

    def blocks_32x8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = block_quantize(w[None], (32, 8))
        return q[0], s[0]

    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 8],
               "modules_to_not_convert": [r".*self_attn", r"model\.layers\.0\.mlp", "mlp.gate", "lm_head"]}
    path = write(moe_models["qwen3_moe"], tmp_path / "b8", qconfig, blocks_32x8, "weight_scale_inv",
                 which=lambda n, t: quantized(n, t) and ".experts." in n)
    assert load_model(path)[0].layers[1].mlp.experts.down_proj.dtype == FP8  # (on CPU: as stored)
    scheme = fp8_config.read_scheme(SimpleNamespace(quantization_config=qconfig), "config.json", None)
    assert scheme is not None
    model, _ = load_model(moe_models["qwen3_moe"])
    names = fp8_checkpoint.prepare(model, scheme, torch.device("cuda"), "config.json")
    ex = model.layers[1].mlp.experts
    assert ex.dequantized_block == (32, 8) and ex.block is None and ex.down_proj.dtype == torch.float32
    with torch.no_grad():
        model.load_weights(fp8_checkpoint.checkpoint_tensors(iter_safetensors([path / "model.safetensors"]), scheme,
                                                             names))
    stored = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    want = stored[name].float() * stored[name + "_scale_inv"].repeat_interleave(32, 0).repeat_interleave(8, 1)
    assert torch.equal(ex.down_proj[3], want) and not ex.pending


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
