"""Checkpoints already float8 (config.json's quantization_config) load as stored and run
on the float8 linear path: compressed-tensors per-channel weights give what quantization
"fp8" computes online; per-tensor and block-scaled weights give what transformers computes
with the checkpoint's dequantized weights and the same input roundings; everything else is
refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.reference import quantize_rows_fp8
from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from streamer.model import quant
from streamer.model.fp8_checkpoint import hf_names
from streamer.model.layers import Linear
from streamer.model.loader import load_model
from tests.conftest import make_tiny_model

FP8 = torch.float8_e4m3fn
# K, N and the q/k/v and gate/up shard boundaries all multiples of 128 (block-scaled layers)
SHAPES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, initializer_range=0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp8ckpt") / "llama", "LlamaForCausalLM", None, **SHAPES)


def ct_config(weights: dict, acts: dict | None, ignore=("lm_head",)) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                          "symmetric": True, "dynamic": False,
                                                                          **weights},
                                      "input_activations": acts}},
    }


def per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_rows_fp8(w)  # what quantization "fp8" does online, s [N, 1] as compressed-tensors stores it
    return q, s


def per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax() / 448.0
    return (w / s).clamp(-448, 448).to(FP8), s.reshape(1)


def block_128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own FineGrainedFP8 quantization (weight, weight_scale_inv [N/128, K/128])."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    op = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=(128, 128))))
    out = op.convert({"w.weight": w})
    return out["w.weight"], out["w.weight_scale_inv"]


def write_checkpoint(src: Path, dst: Path, qconfig: dict, quantize, scale_name: str,
                     keep=("lm_head", "embed_tokens")) -> Path:
    """src's model with every decoder linear weight replaced by quantize(W) = (float8, scale)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dim() == 2 and not any(k in name for k in keep):
            q, s = quantize(t)
            out[name], out[name.removesuffix("weight") + scale_name] = q, s
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qconfig}))
    return dst


PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 29, 70)]


def generate(path: Path, **kw):
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, **kw) as llm:
        outs = llm.generate(prompts(), PARAMS)
    for o in outs:
        assert o.error is None, o.error
    return outs


def logprobs(outs) -> list[torch.Tensor]:
    return [torch.tensor([t.logprob for t in o.logprobs]) for o in outs]


def hf_reference(path: Path, weights: dict[str, torch.Tensor] | None, round_inputs):
    """transformers' model of path (its own loading of the checkpoint where weights is None,
    else the unquantized model given these weights), every decoder linear layer's input
    rounded by round_inputs first: the oracle of a float8 checkpoint's arithmetic."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if weights is not None:
        missing = set(weights) - set(dict(model.named_parameters()))
        assert not missing, missing
        model.load_state_dict(weights, strict=False)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            m.register_forward_pre_hook(lambda mod, args: (round_inputs(args[0]),))
    return model


def assert_matches_reference(hf, path: Path, outs) -> None:
    """Layer by layer, each of our float8 layers given transformers' input computes its
    output (fused q/k/v and gate/up against the shards side by side) to float32 noise.
    End to end, the same greedy tokens and nearly the same logprobs: a last-bit difference
    (another order of float32 sums) that moves one input across a float8 rounding boundary
    changes that value by 1/16, and attention carries it to every later position, so
    logprobs are compared loosely (see tests/model/test_quant.py)."""
    ours, _ = load_model(path)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for name, m in hf.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            # the raw input, before hf_reference's rounding hook: ours rounds it itself
            hooks.append(m.register_forward_pre_hook(lambda mod, a, n=name: seen.__setitem__(n, (a[0][0], None)),
                                                     prepend=True))
            hooks.append(m.register_forward_hook(lambda mod, a, out, n=name: seen.__setitem__(n, (seen[n][0], out[0]))))
    with torch.no_grad():
        hf(torch.tensor([prompts()[2]]))
        for name, m in ours.named_modules():
            if isinstance(m, Linear) and name != "lm_head":
                shards = hf_names(name)
                want = torch.cat([seen[n][1] for n in shards], dim=-1)
                torch.testing.assert_close(m(seen[shards[0]][0]), want, rtol=1e-5, atol=1e-5, msg=name)
    for h in hooks:
        h.remove()
    for p, o, mine in zip(prompts(), outs, logprobs(outs)):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1)
        assert o.token_ids == ref.argmax(-1).tolist()
        diff = (mine - ref.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]).abs()
        assert diff.median() < 2e-2, diff


def per_token(x: torch.Tensor) -> torch.Tensor:
    return quant.fake_quantize_rows(x)


def per_group_128(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    q, s = quant.quantize_groups_fp8(flat, 128)
    return (q.float() * s.repeat_interleave(128, 1)).view(x.shape)


def test_compressed_tensors_per_channel_runs_as_online_fp8_does(tiny, tmp_path):
    """Per-row scales of the online quantization, stored as compressed-tensors: the same
    float8 weights and scales in memory, so the same tokens and the same logprobs."""
    path = write_checkpoint(tiny, tmp_path / "ct", ct_config({"strategy": "channel"},
                                                              {"num_bits": 8, "type": "float", "strategy": "token",
                                                               "dynamic": True, "symmetric": True}),
                            per_row, "weight_scale")
    model, _ = load_model(path)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.out_features,)
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight_scale is None
    named, _ = load_model(path, quantization="compressed-tensors")  # (the format's name: a check, as stored)
    assert torch.equal(named.layers[0].self_attn.qkv_proj.weight, qkv.weight)
    online, _ = load_model(tiny, quantization="fp8")
    for (name, a), b in zip(model.named_modules(), online.modules()):
        if isinstance(a, Linear):
            assert torch.equal(a.weight, b.weight), name
            assert (a.weight_scale is None and b.weight_scale is None) or torch.equal(a.weight_scale, b.weight_scale)
    ours, theirs = generate(path), generate(tiny, quantization="fp8")
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    for a, b in zip(logprobs(ours), logprobs(theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_per_tensor_scales_fill_each_shard_of_a_fused_layer(tiny, tmp_path, fmt):
    """A per-tensor scale per q/k/v (gate/up) shard: each fills its own rows of the fused
    layer. The oracle is transformers with the dequantized weights (its own loading of the
    "fp8" checkpoint; for compressed-tensors, which is not installed, the weights given to
    the unquantized model) and the inputs rounded per token."""
    if fmt == "fp8":
        qconfig, scale_name = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, \
            "weight_scale_inv"
        quantize = lambda w: (lambda q, s: (q, s.reshape(())))(*per_tensor(w))  # noqa: E731 - a scalar, as transformers stores it
    else:
        qconfig = ct_config({"strategy": "tensor"}, {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "dynamic": True})
        quantize, scale_name = per_tensor, "weight_scale"
    path = write_checkpoint(tiny, tmp_path / fmt, qconfig, quantize, scale_name)
    tensors = load_file(str(path / "model.safetensors"))
    model, _ = load_model(path)
    qkv = model.layers[1].self_attn.qkv_proj.weight_scale
    q_s, k_s = (tensors[f"model.layers.1.self_attn.{p}_proj.{scale_name}"] for p in "qk")
    assert torch.equal(qkv[:256], q_s.expand(256)) and torch.equal(qkv[256:384], k_s.expand(128))
    assert q_s != k_s
    dequantized = None
    if fmt == "compressed-tensors":
        dequantized = {n.removesuffix("_scale").removesuffix(".weight") + ".weight": tensors[n.removesuffix("_scale")]
                       .float() * s for n, s in tensors.items() if n.endswith("weight_scale")}
    outs = generate(path)
    assert_matches_reference(hf_reference(tiny if dequantized else path, dequantized, per_token), path, outs)


def test_block_scaled_checkpoint_matches_transformers_loading_it(tiny, tmp_path):
    """DeepSeek-style [128, 128] blocks written by transformers' own FineGrainedFP8
    quantization; transformers loads the checkpoint on CPU by dequantizing it, and rounds
    no inputs, so its layers get the 1 x 128 group rounding of the inputs added."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "fmt": "e4m3"}
    path = write_checkpoint(tiny, tmp_path / "blocks", qconfig, block_128, "weight_scale_inv")
    model, _ = load_model(path)
    up = model.layers[0].mlp.gate_up_proj
    assert up.weight.dtype == FP8 and up.block == (128, 128) and up.weight_scale.shape == (8, 2)
    hf = hf_reference(path, None, per_group_128)
    want = torch.cat([hf.model.layers[0].mlp.gate_proj.weight, hf.model.layers[0].mlp.up_proj.weight])
    assert torch.equal(quant.dequantize_blocks(up.weight, up.weight_scale, up.block), want)
    assert_matches_reference(hf, path, generate(path))


def test_block_scaled_product_handles_partial_blocks():
    """N and K not multiples of the block: the last row and column blocks are shorter, and
    the product is the fp32 product of the dequantized operands."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(80, 200, generator=g), torch.randn(3, 200, generator=g)
    bn, bk = 64, 128
    scale = torch.stack([torch.stack([w[i:i + bn, j:j + bk].abs().amax() / 448 for j in range(0, 200, bk)])
                         for i in range(0, 80, bn)])
    q = (w / quant.expand_blocks(scale, 80, 200, (bn, bk))).to(FP8)
    got = quant.block_fp8_linear(x, q, scale, (bn, bk), None)
    xq = torch.cat([quant.fake_quantize_rows(x[:, :128]), quant.fake_quantize_rows(x[:, 128:])], dim=1)
    torch.testing.assert_close(got, xq @ quant.dequantize_blocks(q, scale, (bn, bk)).t(), rtol=1e-6, atol=1e-6)
    assert (got - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()


def expect_refusal(path: Path, *fragments: str, **kw) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model(path, **kw)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def with_config(tiny: Path, dst: Path, qconfig: dict) -> Path:
    shutil.copytree(tiny, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qconfig}))
    return dst


@pytest.mark.parametrize("qconfig, fragments", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["quant_method 'bitsandbytes' is not supported"]),
    ({"quant_method": "hqq", "bits": 4}, ["quant_method 'hqq' is not supported"]),
    (ct_config({"strategy": "channel", "type": "int"}, {"num_bits": 8, "type": "int", "strategy": "token",
                                                         "dynamic": True}), ["type 'int'", "float8 only"]),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
     ["activation_scheme 'static'", "not implemented"]),
    (ct_config({"strategy": "channel"}, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     ["input_activations dynamic False", "static input scales"]),
    (ct_config({"strategy": "channel"}, None), ["weight-only float8"]),
    (ct_config({"strategy": "block", "block_structure": [128, 128]},
               {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
     ["strategy 'token'", "group_size 128"]),
    (ct_config({"strategy": "channel"}, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
               ignore=["model.layers.0.self_attn.q_proj", "lm_head"]), ["q_proj", "but not all"]),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, ["scale_fmt 'ue8m0'"]),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "kernel": "x"}, ["field 'kernel' is not understood"]),
])
def test_quantization_configs_not_implemented_are_refused_by_name(tiny, tmp_path, qconfig, fragments):
    expect_refusal(with_config(tiny, tmp_path / "m", qconfig), "quantization_config", *fragments)


def test_asking_for_fp8_on_a_checkpoint_quantized_otherwise_is_a_conflict(tiny, tmp_path):
    path = with_config(tiny, tmp_path / "m", {"quant_method": "awq", "bits": 4})
    expect_refusal(path, "quant_method 'awq' conflicts with quantization='fp8'", quantization="fp8")
    expect_refusal(tiny, "quantization 'int8' is not supported", quantization="int8")


def test_fp8_asked_of_a_float8_checkpoint_runs_it_as_stored(tiny, tmp_path):
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = write_checkpoint(tiny, tmp_path / "blocks", qconfig, block_128, "weight_scale_inv")
    model, _ = load_model(path, quantization="fp8")
    assert model.layers[0].self_attn.o_proj.block == (128, 128)
    assert model.lm_head.weight.dtype == torch.float32  # not quantized online on top


def test_a_missing_or_misplaced_scale_names_the_tensor(tiny, tmp_path):
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = write_checkpoint(tiny, tmp_path / "blocks", qconfig, block_128, "weight_scale_inv")
    tensors = load_file(str(path / "model.safetensors"))
    scale = tensors.pop("model.layers.1.mlp.down_proj.weight_scale_inv")
    save_file(tensors, str(path / "model.safetensors"))
    expect_refusal(path, "missing tensor(s)", "layers.1.mlp.down_proj.weight_scale")

    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = scale
    tensors["lm_head.weight_scale_inv"] = torch.ones(4, 2)
    save_file(tensors, str(path / "model.safetensors"))
    expect_refusal(path, "'lm_head.weight_scale_inv' scales a layer the quantization_config does not quantize")

    del tensors["lm_head.weight_scale_inv"]
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].float()
    save_file(tensors, str(path / "model.safetensors"))
    expect_refusal(path, "'model.layers.1.mlp.down_proj.weight' is torch.float32", "float8 e4m3")

    del tensors["model.layers.1.mlp.down_proj.weight"]
    tensors["model.layers.1.mlp.down_proj.input_scale"] = torch.ones(())
    save_file(tensors, str(path / "model.safetensors"))
    expect_refusal(path, "'model.layers.1.mlp.down_proj.input_scale' belongs to a quantization scheme other")


def test_dummy_weights_of_a_float8_config(tiny, tmp_path):
    """load_format "dummy" (benchmarks) builds the float8 layers the config describes."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = with_config(tiny, tmp_path / "m", qconfig)
    model, _ = load_model(path, load_format="dummy")
    o = model.layers[1].self_attn.o_proj
    assert o.weight.dtype == FP8 and torch.equal(o.weight_scale, torch.full((2, 2), 0.02))
    w = quant.dequantize_blocks(o.weight, o.weight_scale, o.block)
    assert 0.01 < w.std() < 0.03


@pytest.mark.parametrize("arch, kw", [("CohereForCausalLM", {}), ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "pad_token_id": 0})])
def test_per_channel_scales_follow_the_rotary_reordering_of_q_k_rows(tmp_path, arch, kw):
    """Cohere's interleaved rotary pairs and partial rotary reorder each q/k head's rows at
    load (LlamaForCausalLM.rotary_permutation): a per-row scale must move with its row. A
    row's float8 value and scale do not depend on where it sits, so the checkpoint loads
    as online quantization (which quantizes the rows after reordering) does, bit for bit."""
    src = make_tiny_model(tmp_path / "src", arch, None, **{**SHAPES, **kw})
    path = write_checkpoint(src, tmp_path / "ct", ct_config({"strategy": "channel"},
                                                             {"num_bits": 8, "type": "float", "strategy": "token",
                                                              "dynamic": True, "symmetric": True}),
                            per_row, "weight_scale")
    model, _ = load_model(path)
    assert model.rotary_permutation() is not None
    online, _ = load_model(src, quantization="fp8")
    a, b = model.layers[0].self_attn.qkv_proj, online.layers[0].self_attn.qkv_proj
    assert torch.equal(a.weight.float(), b.weight.float()) and torch.equal(a.weight_scale, b.weight_scale)
    assert [o.token_ids for o in generate(path)] == [o.token_ids for o in generate(src, quantization="fp8")]


def test_a_block_scale_the_rotary_reordering_would_split_is_refused(tmp_path):
    """head_dim 96 with [128, 128] blocks: a head's rows straddle two blocks, and partial
    rotary's reordering moves rows between them."""
    shapes = {**SHAPES, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 96, "hidden_size": 384,
              "partial_rotary_factor": 0.5, "pad_token_id": 0}
    src = make_tiny_model(tmp_path / "src", "Phi3ForCausalLM", None, **shapes)
    path = write_checkpoint(src, tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                    "activation_scheme": "dynamic"}, block_128, "weight_scale_inv")
    with pytest.raises(ModelLoadError, match="rotary reordering"):
        load_model(path)


def test_a_quantized_checkpoint_never_holds_full_precision_copies_of_its_quantized_layers(tiny, tmp_path,
                                                                                            monkeypatch):
    """The model of a quantized checkpoint is built with its linear weights on the meta
    device (layers.deferred_weights): when prepare gives the quantized layers their float8
    weights, no full-precision weight was ever allocated for them; whatever stays in the
    model's dtype (the LM head) is allocated after, and nothing is left on meta."""
    from streamer.model import fp8_checkpoint

    path = write_checkpoint(tiny, tmp_path / "ct", ct_config({"strategy": "channel"},
                                                              {"num_bits": 8, "type": "float", "strategy": "token",
                                                               "dynamic": True, "symmetric": True}),
                            per_row, "weight_scale")
    seen: dict[str, bool] = {}
    real_prepare = fp8_checkpoint.prepare

    def spy(model, *a, **kw):
        seen.update({n: m.weight.is_meta for n, m in model.named_modules() if isinstance(m, Linear)})
        return real_prepare(model, *a, **kw)

    monkeypatch.setattr(fp8_checkpoint, "prepare", spy)
    model, _ = load_model(path)
    assert seen and all(seen.values()), seen
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert model.layers[0].mlp.down_proj.weight.dtype == FP8 and model.lm_head.weight.dtype == torch.float32
