"""Int4 weight-only checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) load as stored
into Int4Linear layers and run as transformers does with the checkpoint's dequantized
weights. The test quantizes a tiny random Llama itself and packs each format with its own
packers (below, written from the formats' definitions, value by value), so the loader's
unpacking is checked against an independent writer; refusals are checked by message."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.int4 import dequantize
from streamer import LLM, SamplingParams
from streamer.errors import ModelLoadError
from streamer.model.fp8_checkpoint import hf_names
from streamer.model.int4_linear import Int4Linear
from streamer.model.loader import load_model
from tests.conftest import make_tiny_model

SHAPES = dict(vocab_size=512, hidden_size=128, intermediate_size=192, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, initializer_range=0.05)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("int4ckpt") / "llama", "LlamaForCausalLM", None, **SHAPES)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """values 0..15 packed 8 to an int32 along dim; nibble i of word c holds element 8c + order[i]."""
    v = values.to(torch.int64).movedim(dim, -1)
    words = torch.zeros(*v.shape[:-1], v.shape[-1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= v[..., order[i]::8] << (4 * i)
    return to_int32(words).movedim(-1, dim).contiguous()


def quantize(w: torch.Tensor, group: int, sym: bool, scale_dtype, g_idx: torch.Tensor | None = None,
             min_zero: int = 0):
    """Min-max int4 of W [N, K] by groups (g_idx[k]: k's group, else k // group): q [N, K]
    0..15, zeros and scales [N, groups], and the dequantized W (float32)."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = k // group
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    if sym:
        scales = (torch.maximum(-lo, hi) / 7.5).to(scale_dtype)
        zeros = torch.full((n, groups), 8)
    else:
        scales = ((hi - lo) / 15).to(scale_dtype)
        zeros = (-lo / scales.float()).round().clamp(min_zero, 15).long()
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    q = (w / s + z).round().clamp(0, 15).long()
    return q, zeros, scales, (q - z).float() * s


def quantize_checkpoint(src: Path, dst: Path, fmt: str, group: int | None, desc_act: bool = False,
                        sym: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """src's decoder linear layers written in fmt (group None: one per row, compressed-tensors'
    channel strategy); also returns the dequantized weights."""
    per_row = group is None
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, deq = {}, {}
    perms: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        if not (re.search(r"(proj|proj_with_mqa|experts\.\d+\.w[123])\.weight$", name) and t.dim() == 2):  # (w1-3: Mixtral)
            out[name] = t
            continue
        n, k = t.shape
        group = k if per_row else group
        g_idx = None
        if desc_act:  # one order per input (q/k/v share theirs, gate/up theirs), as GPTQ's Hessian gives
            parent, leaf = base.rsplit(".", 1)
            key = parent + {"q_proj": ".qkv", "k_proj": ".qkv", "v_proj": ".qkv", "gate_proj": ".gu",
                            "up_proj": ".gu", "w1": ".gu", "w3": ".gu"}.get(leaf, leaf)  # (w1/w3: Mixtral's)
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[perm] = torch.arange(k) // group
        q, zeros, scales, w = quantize(t, group, sym, torch.bfloat16 if fmt.startswith("ct") else torch.float16,
                                       g_idx, min_zero=1 if fmt == "gptq" else 0)
        deq[name] = w
        if fmt == "awq":
            out[base + ".qweight"] = pack(q.t(), 1, AWQ_ORDER)
            out[base + ".qzeros"] = pack(zeros.t(), 1, AWQ_ORDER)
            out[base + ".scales"] = scales.t().contiguous()
        elif fmt == "gptq":
            out[base + ".qweight"] = pack(q.t(), 0)
            out[base + ".qzeros"] = pack((zeros.t() - 1) & 0xF, 1)  # (v1 stores zero - 1)
            out[base + ".scales"] = scales.t().contiguous()
            out[base + ".g_idx"] = (torch.arange(k) // group if g_idx is None else g_idx).to(torch.int32)
        else:  # compressed-tensors: signed values -8..7 stored + 8
            out[base + ".weight_packed"] = pack((q - 8) + 8, 1)
            out[base + ".weight_scale"] = scales
            out[base + ".weight_shape"] = torch.tensor([n, k])
            if not sym:
                out[base + ".weight_zero_point"] = pack((zeros - 8) + 8, 0)
            if desc_act:
                out[base + ".weight_g_idx"] = g_idx.to(torch.int32)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    qc = qconfig(fmt, None if per_row else group, desc_act, sym)
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst, deq


def qconfig(fmt: str, group: int | None, desc_act: bool = False, sym: bool = False) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if group is None else "group",
                "group_size": group, "dynamic": False, "actorder": "group" if desc_act else None,
                "observer": "minmax"}, "input_activations": None}}}


PROMPTS = [[5, 17, 300, 42, 9], list(range(3, 40)), [7] * 3 + list(range(100, 160))]


def hf_dequantized(src: Path, deq: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    missing = set(deq) - set(dict(model.named_parameters()))
    assert not missing, missing
    model.load_state_dict(deq, strict=False)
    return model


VARIANTS = [("awq", 32, False, False), ("gptq", 32, False, False), ("gptq", 64, True, False),
            ("gptq", 32, False, True), ("ct", 32, False, True), ("ct", 64, False, False), ("ct", 32, True, False),
            ("ct", None, False, True)]


@pytest.mark.parametrize("fmt,group,desc_act,sym", VARIANTS,
                         ids=["awq", "gptq", "gptq-desc_act", "gptq-sym", "ct-sym", "ct-asym", "ct-actorder",
                              "ct-channel"])
def test_int4_checkpoint_runs_as_transformers_on_its_dequantized_weights(tiny, tmp_path, fmt, group, desc_act, sym):
    path, deq = quantize_checkpoint(tiny, tmp_path / fmt, fmt, group, desc_act, sym)
    model, _ = load_model(path)
    qkv = model.layers[0].self_attn.qkv_proj
    n, k = qkv.out_features, qkv.in_features
    assert isinstance(qkv, Int4Linear) and qkv.weight.dtype == torch.int32 and qkv.weight.shape == (n, k // 8)
    assert qkv.weight_scale.shape == qkv.weight_zero.shape == (n, 1 if group is None else k // group)
    assert (qkv.perm is not None) == desc_act
    assert model.lm_head.weight.dtype == torch.float32 and not isinstance(model.lm_head, Int4Linear)
    # the layout in memory is the packer's weights, fused parts side by side (and K in the act order)
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            w = dequantize(m.weight, m.weight_scale, m.weight_zero, m.group, torch.float32)
            if m.perm is not None:
                w = w[:, torch.argsort(m.perm)]
            torch.testing.assert_close(w, torch.cat([deq[f"{h}.weight"] for h in hf_names(name)]), rtol=0, atol=0)
    generates_as(path, hf_dequantized(tiny, deq), 10)


def generates_as(path: Path, hf, tokens: int) -> None:
    """streamer on the int4 checkpoint at path: transformers' (hf, on the dequantized weights) greedy
    tokens for PROMPTS, and their logprobs within 1e-3."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32) as llm:
        outs = llm.generate(PROMPTS, params)
    for p, o in zip(PROMPTS, outs):
        assert o.error is None, o.error
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
        assert o.token_ids == want[0, len(p):].tolist()
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([t.logprob for t in o.logprobs]), ref, rtol=0, atol=1e-3)


def test_qwen2_awq_with_qkv_biases(tmp_path):
    """Qwen2's q/k/v biases (unquantized in AWQ and GPTQ checkpoints) add to the int4 layer's output."""
    tiny = make_tiny_model(tmp_path / "qwen2", "Qwen2ForCausalLM", None, **SHAPES)
    tensors = load_file(str(tiny / "model.safetensors"))  # (transformers initializes biases to zero)
    g = torch.Generator().manual_seed(9)
    tensors = {n: torch.randn(t.shape, generator=g) * 0.3 if n.endswith("bias") else t for n, t in tensors.items()}
    save_file(tensors, str(tiny / "model.safetensors"))
    path, deq = quantize_checkpoint(tiny, tmp_path / "awq", "awq", 32)
    model, _ = load_model(path)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.bias is not None and bool(qkv.bias.abs().sum() > 0)
    hf = hf_dequantized(tiny, deq)
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
        assert o.token_ids == want.tolist()


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_cohere_int4_rows_follow_the_rotary_reordering(tmp_path, fmt):
    """Cohere rotates interleaved pairs: the loader reorders each q/k head's rows after loading,
    and the int4 layer's packed rows, scales and zeros move with them (Int4Linear.permute_rows).
    Greedy output is transformers' on the checkpoint's dequantized weights."""
    tiny = make_tiny_model(tmp_path / "cohere", "CohereForCausalLM", None, **SHAPES)
    path, deq = quantize_checkpoint(tiny, tmp_path / fmt, fmt, 32)
    hf = hf_dequantized(tiny, deq)
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32) as llm:
        assert isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj, Int4Linear)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
        assert o.token_ids == want.tolist()


def with_config(tiny: Path, dst: Path, qc: dict, arch_overrides: dict | None = None) -> Path:
    shutil.copytree(tiny, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(arch_overrides or {}), "quantization_config": qc}))
    return dst


REFUSALS = [
    ({**qconfig("awq", 32), "bits": 8}, "bits 8 is not supported"),
    ({**qconfig("gptq", 32), "bits": 3}, "bits 3 is not supported"),
    ({**qconfig("awq", 32), "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({**qconfig("awq", 32), "zero_point": False}, "zero_point false is not supported"),
    ({**qconfig("awq", 32), "some_new_knob": 1}, "field 'some_new_knob' is not understood (quant_method 'awq')"),
    ({**qconfig("gptq", 32), "some_new_knob": 1}, "field 'some_new_knob' is not understood (quant_method 'gptq')"),
    ({**qconfig("gptq", 32), "lm_head": True}, "lm_head true is not supported"),
    ({**qconfig("gptq", 32), "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({**qconfig("gptq", 24)}, "group_size 24 is not supported"),
    ({**qconfig("ct", 32), "ignore": []}, "quantizes lm_head"),
    ({**qconfig("ct", 32), "config_groups": {"group_0": {**qconfig("ct", 32)["config_groups"]["group_0"],
                                                         "weights": {"num_bits": 8, "type": "int",
                                                                     "strategy": "group", "group_size": 32}}}},
     "num_bits 8 is not supported"),
    ({**qconfig("ct", 32), "config_groups": {"group_0": {**qconfig("ct", 32)["config_groups"]["group_0"],
                                                         "weights": {"num_bits": 4, "type": "int",
                                                                     "strategy": "group", "group_size": 32,
                                                                     "mystery": 1}}}},
     "config_groups.group_0.weights field 'mystery' is not understood"),
]


@pytest.mark.parametrize("qc,message", REFUSALS, ids=[m.split(" is")[0] for _, m in REFUSALS])
def test_refused_by_name(tiny, tmp_path, qc, message):
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(with_config(tiny, tmp_path / "m", qc))


def test_quantization_fp8_on_an_int4_checkpoint_is_refused(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="quant_method 'awq' conflicts with quantization='fp8' \\(its int4 weights run as stored"):
        load_model(with_config(tiny, tmp_path / "m", qconfig("awq", 32)), quantization="fp8")


@pytest.mark.parametrize("fmt,names", [("awq", ("awq", "awq_marlin")), ("gptq", ("gptq", "gptq_marlin")),
                                       ("ct", ("compressed-tensors",))])
def test_quantization_may_name_the_checkpoints_own_format(tiny, tmp_path, fmt, names):
    """vLLM's names for a checkpoint's format (its Marlin kernels' too) are a check: the checkpoint runs as
    stored, as with no value; another format's name, or any on an unquantized checkpoint, is refused."""
    path, _ = quantize_checkpoint(tiny, tmp_path / fmt, fmt, 32)
    plain, _ = load_model(path)
    for name in names:
        model, _ = load_model(path, quantization=name)
        assert type(model.layers[0].self_attn.qkv_proj) is type(plain.layers[0].self_attn.qkv_proj) is Int4Linear
    method = {"awq": "awq", "gptq": "gptq", "ct": "compressed-tensors"}[fmt]
    other = "gptq" if fmt == "awq" else "awq_marlin"
    with pytest.raises(ModelLoadError, match=f"quantization='{other}' names a '.*' checkpoint, but config.json has "
                                             f"quant_method '{method}'"):
        load_model(path, quantization=other)
    with pytest.raises(ModelLoadError, match=f"quantization='{names[0]}' names .* but config.json has no "
                                             "quantization_config \\(an unquantized checkpoint"):
        load_model(tiny, quantization=names[0])


def test_desc_act_orders_that_differ_within_a_fused_layer_are_refused(tiny, tmp_path):
    path, _ = quantize_checkpoint(tiny, tmp_path / "g", "gptq", 64, desc_act=True)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="_proj.g_idx' differs from the g_idx of the other parts"):
        load_model(path)


def test_tensor_parallel_int4_passes_the_checks():
    """(Each rank reads its part of the packed tensors: tests/distributed/test_tp_quantized.py.)"""
    from streamer.distributed.checks import check_model

    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config=qconfig("awq", 32),
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
                         hidden_size=128)
    check_model(SimpleNamespace(tensor_parallel_size=2), hf, Path("x"))


def test_dummy_weights_of_an_int4_config(tiny, tmp_path):
    """load_format "dummy" (benchmarks) fills int4 layers with valid values: zeros 8, small scales."""
    model, _ = load_model(with_config(tiny, tmp_path / "m", qconfig("gptq", 32)), load_format="dummy")
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4Linear) and bool((layer.weight_zero == 8).all()) and layer.perm is None
    y = layer(torch.randn(3, layer.in_features))
    assert y.shape == (3, layer.out_features) and bool(y.isfinite().all()) and 0 < y.abs().max() < 10
