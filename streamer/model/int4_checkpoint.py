"""Checkpoints with 4-bit weights and 16-bit activations (W4A16): config.json's
`quantization_config` read at load (model/loader.py asks `scheme_of` first, then fp8_checkpoint).

Three formats, each packing int4 values 0..15 eight to an int32, W[n, k] = (q - z) * s with
one scale s and zero z per row n and group of G consecutive k:

- quant_method "awq" (AutoAWQ, version "gemm", zero_point true): per linear layer `qweight`
  [K, N / 8] and `qzeros` [K / G, N / 8], both packed along N with the nibbles of a word in
  AWQ's interleaved order (nibble i holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]), `scales`
  fp16 [K / G, N].
- quant_method "gptq" (checkpoint_format "gptq", or "gptq_v2"): `qweight` [K / 8, N] packed
  along K in order, `qzeros` [K / G, N / 8] packed along N in order and storing z - 1 (v1;
  v2 stores z), `scales` [K / G, N], `g_idx` [K]: the group of each k. With desc_act the
  groups are not runs of k: the layer's K is permuted at load so that they are (each group
  must have exactly G members), and its inputs are permuted by the same order at run time.
- quant_method "compressed-tensors", format "pack-quantized", weights {num_bits 4, type
  int, strategy group (group_size) or channel}: `weight_packed` [N, K / 8] packed along K in
  order, values stored + 8 (signed -8..7 offset to unsigned), `weight_scale` [N, K / G],
  `weight_zero_point` [N / 8, K / G] packed along N (+ 8 as well) when asymmetric, else the
  zero is 8; `weight_shape` [N, K] is checked and dropped; with actorder "group",
  `weight_g_idx` [K] is GPTQ's g_idx and handled as it is.

Every quantized linear layer becomes an `Int4Linear` (model/int4_linear.py: the layer and the
loaders that repack each format) holding kernels/int4.py's one layout
(`qweight` [N, K / 8] packed along K in order, scales in the model's dtype, zeros uint8),
rows along N so that the parts of a fused q/k/v or gate/up layer each fill their row range
(scales and zeros concatenate along N; all parts share K and G). The LM head, embeddings and
norms stay in the model's dtype. The experts of a mixture of experts (one tensor per expert and
projection in these checkpoints) go into one stacked layout of the same kind (model/moe.py
Experts.expect_int4, kernels/moe_int4.py). Refused by name: other bits, methods' variants and fields
this module does not know, quantized LM heads, int4 experts of architectures that store their experts
otherwise (gpt-oss, Granite MoE),
quantization "fp8" on top, layers whose shape the format cannot pack. A model that permutes
its q/k rows after loading (partial rotary, Cohere's interleaved pairs, DeepSeek's interleaved
rotary) permutes the int4 layer's rows with them (`Int4Linear.permute_rows`); a layer that is
read as a matrix rather than run (`int4_dequantized`: DeepSeek's kv_b_proj) is dequantized once
loaded (`Int4Linear.dense`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from streamer.errors import ModelLoadError
from streamer.model.experts import Experts
from streamer.model.fp8_checkpoint import quantized_linears
from streamer.model.fp8_config import _ct_matches, ct_args, ct_group, ct_targets, refuse
from streamer.model.int4_linear import Int4Linear, pack, unpack
from streamer.model.layers import Linear
from streamer.model.llama import LlamaForCausalLM
from streamer.model.moe import MoEForCausalLM
from streamer.model.tp_group import current as tensor_parallel

AWQ_FIELDS = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version", "backend",
              "modules_to_not_convert", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"}
# calibration settings and runtime kernel choices, which do not change what the file stores
GPTQ_FIELDS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format", "lm_head",
               "dynamic", "pack_dtype", "modules_in_block_to_quantize", "block_name_to_quantize", "true_sequential",
               "static_groups", "damp_percent", "damp_auto_increment", "model_name_or_path", "model_file_base_name",
               "meta", "tokenizer", "dataset", "use_exllama", "exllama_config", "max_input_length",
               "cache_block_outputs", "module_name_preceding_first_block", "batch_size", "pad_token_id", "model_seqlen",
               "use_cuda_fp16", "backend", "disable_exllama"}
# checkpoint tensor leaf -> Int4Linear's parameter, per method
NAMES = {
    "awq": {"qweight": "weight", "qzeros": "weight_zero", "scales": "weight_scale"},
    "gptq": {"qweight": "weight", "qzeros": "weight_zero", "scales": "weight_scale", "g_idx": "g_idx"},
    "compressed-tensors": {"weight_packed": "weight", "weight_zero_point": "weight_zero",
                           "weight_scale": "weight_scale", "weight_shape": "weight_shape", "weight_g_idx": "g_idx"},
}
FOREIGN = ("weight_scale_inv", "input_scale", "weight_global_scale", "k_scale", "v_scale")


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How a checkpoint's int4 layers are stored."""

    method: str
    group: int
    """Consecutive k per scale and zero; -1: one group per row (K)."""
    zeros: bool
    """Whether zeros are stored (else every zero is 8: symmetric compressed-tensors)."""
    zero_offset: int = 0
    """Added to a stored zero (GPTQ v1 stores z - 1)."""
    g_idx: bool = False
    """Whether each layer stores the group of each k (GPTQ's g_idx, compressed-tensors' weight_g_idx)."""
    skip: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)

    def quantized(self, module: str) -> bool:
        """Whether the linear layer of this transformers name is int4 in the checkpoint."""
        if module == "lm_head" or module.endswith(".lm_head"):
            return False  # (read_scheme refuses the configs that quantize it)
        if self.method == "awq":  # AutoAWQ skips a module whose name contains an entry
            return not any(p in module for p in self.skip)
        if self.method == "gptq":
            return True
        if any(_ct_matches(module, p) for p in self.skip):
            return False
        return any(t == "Linear" or _ct_matches(module, t) for t in self.targets)


def scheme_of(hf_config: Any, source: str, requested: str | None) -> Int4Scheme | None:
    """The checkpoint's int4 scheme; None where its quantization_config (if any) is no int4
    method's, for fp8_config.read_scheme to read or refuse."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return read_scheme(qc, source, requested) if is_int4(qc) else None


def is_int4(qc: dict) -> bool:
    """Whether this quantization_config names an int4 method (refused here if not 4 bits)."""
    if qc.get("quant_method") in ("awq", "gptq"):
        return True
    groups = qc.get("config_groups") or {}
    return qc.get("quant_method") == "compressed-tensors" and "pack-quantized" in (
        qc.get("format"), *(g.get("format") for g in groups.values() if isinstance(g, dict)))


def read_scheme(qc: dict, source: str, requested: str | None) -> Int4Scheme:
    method = qc["quant_method"]
    if requested is not None:
        raise refuse(source, f"quant_method {method!r} conflicts with quantization={requested!r} (its int4 weights "
                     "run as stored: pass no quantization)")
    if method == "awq":
        return _awq(qc, source)
    if method == "gptq":
        return _gptq(qc, source)
    return _compressed_tensors(qc, source)


def _group(g: Any, source: str) -> int:
    if g == -1 or g is None:
        return -1
    if not isinstance(g, int) or g <= 0 or g % 16:  # (the GEMM's K tile divides it: tl.dot takes 16 or more)
        raise refuse(source, f"group_size {g!r} is not supported (a positive multiple of 16, or -1)")
    return g


def _awq(qc: dict, source: str) -> Int4Scheme:
    unknown = sorted(set(qc) - AWQ_FIELDS)
    if unknown:
        raise refuse(source, f"field {unknown[0]!r} is not understood (quant_method 'awq')")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse(source, f"bits {bits!r} is not supported (quant_method 'awq': 4 only)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(source, f"AWQ version {qc.get('version')!r} is not supported (the 'gemm' packing only)")
    if qc.get("zero_point", True) is not True:
        raise refuse(source, "zero_point false is not supported (quant_method 'awq' with zero points only)")
    group = _group(qc.get("group_size", qc.get("q_group_size")), source)
    return Int4Scheme("awq", group, True, skip=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict, source: str) -> Int4Scheme:
    unknown = sorted(set(qc) - GPTQ_FIELDS)
    if unknown:
        raise refuse(source, f"field {unknown[0]!r} is not understood (quant_method 'gptq')")
    if qc.get("bits") != 4:
        raise refuse(source, f"bits {qc.get('bits')!r} is not supported (quant_method 'gptq': 4 only)")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(source, f"checkpoint_format {fmt!r} is not supported (GPTQ's 'gptq' or 'gptq_v2' packing)")
    if qc.get("lm_head"):
        raise refuse(source, "lm_head true is not supported: the LM head stays in the model's dtype")
    if qc.get("dynamic"):
        raise refuse(source, "dynamic (per-module bits or group sizes) is not supported")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise refuse(source, f"pack_dtype {qc['pack_dtype']!r} is not supported (int32)")
    if qc.get("modules_in_block_to_quantize"):
        raise refuse(source, "modules_in_block_to_quantize is not supported (every linear layer of the decoder "
                     "must be quantized)")
    if qc.get("block_name_to_quantize") not in (None, "model.layers"):
        raise refuse(source, f"block_name_to_quantize {qc['block_name_to_quantize']!r} is not supported")
    return Int4Scheme("gptq", _group(qc.get("group_size"), source), True, zero_offset=1 if fmt == "gptq" else 0,
                      g_idx=True)


def _compressed_tensors(qc: dict, source: str) -> Int4Scheme:
    where, group, fmt = ct_group(qc, source, "int4")
    if fmt != "pack-quantized":
        raise refuse(source, f"{where} format {fmt!r} is not supported with int4 weights (pack-quantized)")
    if group.get("input_activations") or group.get("output_activations"):
        raise refuse(source, f"{where} quantizes activations: only weight-only int4 (W4A16) is implemented")
    w = group.get("weights") or {}
    ct_args(w, f"{where}.weights", source, "int", 4, "pack-quantized: type 'int', num_bits 4")
    if w.get("dynamic"):
        raise refuse(source, f"{where}.weights dynamic {w['dynamic']!r} is not supported")
    if w.get("actorder") not in (None, "weight", "static", "group"):
        raise refuse(source, f"{where}.weights actorder {w['actorder']!r} is not supported (group, weight or static)")
    strategy = w.get("strategy")
    if strategy == "group":
        g = _group(w.get("group_size"), source)
    elif strategy == "channel":
        g = -1
    else:
        raise refuse(source, f"{where}.weights strategy {strategy!r} is not supported (group or channel)")
    targets = ct_targets(group, where, source)
    skip = tuple(qc.get("ignore") or ())
    # (actorder "group" stores weight_g_idx, GPTQ's g_idx; "weight" and "static" only ordered the quantization)
    scheme = Int4Scheme("compressed-tensors", g, w.get("symmetric", True) is not True, skip=skip, targets=targets,
                        g_idx=w.get("actorder") == "group")
    if not any(_ct_matches("lm_head", p) for p in skip) and any(t == "Linear" or _ct_matches("lm_head", t)
                                                                 for t in targets):
        raise refuse(source, "quantizes lm_head (not in ignore): the LM head stays in the model's dtype")
    return scheme


def prepare(model: LlamaForCausalLM, scheme: Int4Scheme, device: torch.device, source: str) -> set[str]:
    """Replace each linear layer the checkpoint stores as int4 by an Int4Linear awaiting its
    tensors. Returns those layers' transformers names."""
    quantized: set[str] = set()
    if isinstance(model, MoEForCausalLM):
        quantized |= _prepare_experts(model, scheme, device, source)
    for name, m, names in quantized_linears(model, scheme, source):
        if type(m) is not Linear and not getattr(m, "int4_dequantized", False):
            raise refuse(source, f"quantizes {name} ({type(m).__name__}) to int4, which is not implemented")
        k, group = m.in_features, (m.in_features if scheme.group == -1 else scheme.group)
        if k % group or group % 16 or (scheme.method != "compressed-tensors" and m.out_features % 8):
            tp = tensor_parallel()
            part = "" if tp is None else f" (this rank's part under tensor_parallel_size={tp.size})"
            raise refuse(source, f"quantizes {name} of shape {tuple(m.weight.shape)}{part} with group_size "
                         f"{scheme.group}; int4 layers need K a multiple of the group size, itself of 16 (and N of "
                         "8 for AWQ and GPTQ)")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, Int4Linear(m, scheme, device))
        quantized.update(names)
    return quantized


def _prepare_experts(model: MoEForCausalLM, scheme: Int4Scheme, device: torch.device, source: str) -> set[str]:
    """The sparse layers whose experts the checkpoint stores as int4, made to expect them
    (Experts.expect_int4: one stacked layout, each expert's projections repacked into it as they
    load). Returns the experts' projections' transformers names."""
    name_of = type(model).__name__
    quantized: set[str] = set()
    for i, layer in enumerate(model.layers):
        ex = getattr(layer.mlp, "experts", None)
        if ex is None:
            continue
        names = [f"model.layers.{i}.{model.legacy_block}.experts.{e}.{p}" for e in range(model.num_experts())
                 for p in model.expert_names]
        int4 = [scheme.quantized(n) for n in names]
        if not any(int4):
            continue
        if not model.int4_experts:
            raise refuse(source, f"quantizes the experts of {name_of} to int4 ({scheme.method}): int4 experts of "
                         "this architecture are not implemented")
        if not all(int4):
            raise refuse(source, f"quantizes some experts of layer {i} to int4 and not others: not implemented")
        hidden, inter = ex.down_proj.shape[1], ex.down_proj.shape[2]  # (inter: this rank's part under TP)
        for k in (hidden, inter):
            group = k if scheme.group == -1 else scheme.group
            if k % group or group % 16 or hidden % 8 or inter % 8:
                tp = tensor_parallel()
                part = "" if tp is None else f" (this rank's part under tensor_parallel_size={tp.size})"
                raise refuse(source, f"quantizes experts of hidden size {hidden} and intermediate size {inter}{part} "
                             f"with group_size {scheme.group}; int4 experts need both multiples of the group size, "
                             "itself of 16 (and of 8)")
        ex.expect_int4(scheme, device)
        quantized.update(names)
    return quantized


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor, str]], scheme: Int4Scheme,
                       quantized: set[str]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """The checkpoint's tensors with each int4 layer's under Int4Linear's names, refusing what
    contradicts the quantization_config."""
    names = NAMES[scheme.method]
    for name, tensor, source in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in names:
            if module not in quantized:
                raise ModelLoadError(f"{source}: tensor {name!r} is int4 ({scheme.method}) but the "
                                     f"quantization_config keeps {module} unquantized")
            yield f"{module}.{names[leaf]}", tensor, source
        elif leaf in FOREIGN or any(leaf in other for other in NAMES.values()):
            raise ModelLoadError(f"{source}: tensor {name!r} belongs to a quantization scheme other than the "
                                 f"quantization_config's ({scheme.method} int4)")
        elif leaf == "weight" and module in quantized:
            raise ModelLoadError(f"{source}: tensor {name!r} is unquantized but the quantization_config makes "
                                 f"{module} int4 ({scheme.method})")
        else:
            yield name, tensor, source


def finish(model: nn.Module) -> None:
    """After loading: GPTQ's act-order layers (and experts) permuted so that each group is a run of K."""
    for name, m in model.named_modules():
        if isinstance(m, Experts) and m.int4 is not None:
            m.order_groups()
        if isinstance(m, Int4Linear) and m.g_idx is not None:
            _order_groups(m, name)


def _order_groups(m: Int4Linear, name: str) -> None:
    assert m.g_idx is not None
    k, group = m.in_features, m.group
    g = m.g_idx.data.long()
    if torch.equal(g, torch.arange(k, device=g.device) // group):
        return
    counts = torch.bincount(g.clamp(0, k // group), minlength=k // group + 1)
    if bool((g < 0).any() or (g >= k // group).any()) or not bool((counts[: k // group] == group).all()):
        raise ModelLoadError(f"{name}.g_idx: not {k // group} groups of {group} columns each (act order "
                             "with groups of other sizes is not supported)")
    perm = torch.argsort(g, stable=True)
    q = unpack(m.weight.data)[:, perm]
    m.weight.data.copy_(pack(q))
    m.perm = perm


def fill_dummy(model: nn.Module, gen: torch.Generator) -> None:
    """load_format "dummy": random int4 values, zeros 8, scales that give W about N(0, 0.02)."""
    for m in model.modules():
        if isinstance(m, Experts) and m.int4 is not None:
            assert m.gate_up_proj_scale is not None and m.down_proj_scale is not None
            assert m.gate_up_proj_zero is not None and m.down_proj_zero is not None
            for t in (m.gate_up_proj, m.down_proj):
                t.data.random_(generator=gen)
            for t in (m.gate_up_proj_scale, m.down_proj_scale):
                t.fill_(0.005)
            for t in (m.gate_up_proj_zero, m.down_proj_zero):
                t.fill_(8)
            for name, g in m.g_idx.items():  # (in order: no perm)
                group = m.int4_groups[0 if name == "gate_up_proj" else 1]
                g.copy_(torch.arange(g.shape[1], device=g.device) // group)
        if isinstance(m, Int4Linear):
            m.weight.data.random_(generator=gen)  # (every bit pattern is a valid word of 8 values)
            m.weight_scale.data.fill_(0.005)
            m.weight_zero.data.fill_(8)
            if m.g_idx is not None:
                m.g_idx.data.copy_(torch.arange(m.in_features, device=m.g_idx.device) // m.group)
            if m.bias is not None:
                m.bias.data.zero_()
