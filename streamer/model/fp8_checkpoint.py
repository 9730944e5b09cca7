"""Checkpoints that are already float8: config.json's `quantization_config` read at load
(model/fp8_config.py reads it into an Fp8Scheme; this module builds and fills the layers).

Two formats are understood (their meaning as transformers and compressed-tensors define it):

- quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3 / Qwen3-FP8 style): weights
  float8 e4m3 with `weight_scale_inv` (despite the name, the multiplier: W = q * scale), one
  per [bn, bk] block with `weight_block_size`, or one per tensor without it; activations
  "dynamic" (per token and per group of bk columns for blocks, per token otherwise). The
  LM head stays unquantized, as transformers keeps it, plus `modules_to_not_convert`.
- quant_method "compressed-tensors", format "float-quantized" or "naive-quantized", one
  config group: weights {num_bits 8, type float, strategy tensor | channel | block} with
  `weight_scale`, input_activations {dynamic true, strategy token | tensor | group (with
  block weights)}; `ignore` lists the layers kept in the model's dtype.

The weights stay float8 in memory and run through streamer/model/quant.py: per-tensor and
per-channel scales become the per-row scales of quantization "fp8" (a per-tensor scale
fills its shard's rows of a fused q/k/v or gate/up layer), block scales go through
`block_fp8_linear`. A mixture of experts' float8 experts run on fused_moe's float8 paths,
loaded expert by expert (model/moe.py): per-tensor or per-channel scales (inputs per token)
as per-row scales; block scales as stored, each projection's grid, the inputs quantized per
token and per group of bk columns (Experts.block). One case is dequantized into the model's
dtype as it loads instead: block-scaled experts on CUDA whose bk is not a multiple of 16
(the MoE kernels' K tile divides bk and a tl.dot's is at least 16). Everything else a
quantization_config can say (other methods, int8, static input scales, weight-only
float8, quantized embeddings, KV-cache scales) is refused by name: running such a
checkpoint as if it were something else would be silently wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamer.errors import ModelLoadError
from streamer.model import quant
from streamer.model.experts import Experts
from streamer.model.fp8_config import Fp8Scheme, refuse
from streamer.model.layers import Linear
from streamer.model.llama import STACKED, LlamaForCausalLM
from streamer.model.moe import MoEForCausalLM

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
# tensor names a float8 layer's scales may have in a checkpoint, per format
SCALE_NAMES = {"fp8": ("weight_scale_inv", "weight_scale"), "compressed-tensors": ("weight_scale",)}
# tensors of quantization schemes this module refuses; present anyway, they contradict the config
FOREIGN = ("input_scale", "activation_scale", "output_scale", "weight_zero_point", "weight_global_scale",
           "k_scale", "v_scale", "weight_packed", "weight_shape", "qweight", "qzeros", "scales", "g_idx")

def hf_names(name: str, fused_checkpoint: bool = False) -> list[str]:
    """The transformers names of our linear layer `name` (a fused one has several, unless
    the checkpoint stores it fused too: fused_checkpoint, Phi-3's qkv_proj and gate_up_proj)."""
    prefix = "" if name == "lm_head" else "model."
    for fused in set() if fused_checkpoint else {g for g, _ in STACKED.values()}:
        if name.endswith(fused):
            base = name.removesuffix(fused)
            return [f"{prefix}{base}{frag}" for frag, (g, _) in STACKED.items() if g == fused]
    return [prefix + name]


def quantized_linears(model: LlamaForCausalLM, scheme: Any, source: str) -> Iterator[tuple[str, Linear, list[str]]]:
    """(name, layer, its transformers names) of each linear layer the scheme (float8 or int4)
    quantizes; a fused layer whose parts the checkpoint quantizes unevenly is refused."""
    for name, m in list(model.named_modules()):
        if not isinstance(m, Linear):
            continue
        names = hf_names(name, model.fused_checkpoint)
        flags = {scheme.quantized(n) for n in names}
        if len(flags) > 1:
            raise refuse(source, f"quantizes some of {', '.join(names)} but not all; streamer fuses them into one layer")
        if flags.pop():
            yield name, m, names


def prepare(model: LlamaForCausalLM, scheme: Fp8Scheme, device: torch.device, source: str) -> set[str]:
    """Give each layer the checkpoint stores as float8 an empty float8 weight and its scales
    (each with the weight_loader load_weights calls). Returns those layers' transformers names."""
    quantized: set[str] = set()
    for name, m, names in quantized_linears(model, scheme, source):
        if name == "lm_head" and model.tie_word_embeddings:
            raise refuse(source, "quantizes lm_head, which this model ties to its (unquantized) embeddings")
        if not quant.fp8_shapes_ok(m.weight):
            raise refuse(source, f"quantizes {name} of shape {tuple(m.weight.shape)}; the float8 GEMM needs both "
                         "dimensions to be multiples of 16")
        if scheme.block is not None and device.type == "cuda":
            _check_cuda_blocks(scheme.block, device, source)
        _make_fp8(m, scheme, device)
        quantized.update(names)
    if isinstance(model, MoEForCausalLM):
        quantized |= _prepare_experts(model, scheme, device, source)
    return quantized


def _prepare_experts(model: MoEForCausalLM, scheme: Fp8Scheme, device: torch.device, source: str) -> set[str]:
    """Float8 experts where the checkpoint stores them so: each expert projection's scale
    (per tensor or per channel) becomes fused_moe's per-row scales, its inputs quantized per
    token as the scheme's dynamic activations are; block scales stay block grids, the inputs
    quantized per token and group (Experts.block), except on CUDA with a bk the kernels cannot
    tile, dequantized into the model's dtype as they load (Experts.dequantized_block). The
    names of the experts' projections."""
    quantized: set[str] = set()
    dequantized: torch.dtype | None = None
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if not isinstance(experts, Experts):
            continue
        base = f"model.layers.{i}.{model.legacy_block}.experts"
        names = [f"{base}.{e}.{p}" for e in range(model.num_experts()) for p in model.expert_names]
        flags = {scheme.quantized(n) for n in names}
        if len(flags) > 1:
            raise refuse(source, f"quantizes some of the projections of {base} but not all; streamer stacks "
                         "every expert of a layer into one tensor")
        if not flags.pop():
            continue
        if scheme.block is not None:
            bn, bk = scheme.block
            inter = experts.down_proj.shape[2]
            tp = getattr(layer.mlp, "tp", None)
            if tp is not None and (inter % bn or inter % bk):
                raise refuse(source, f"weight blocks {list(scheme.block)} with tensor parallelism: each rank's "
                             f"{inter} rows of {base}'s intermediate size would start inside a block")
            quantized.update(names)
            if device.type == "cuda" and bk % 16:
                # (the kernels' K tile divides bk: these experts run in the model's dtype)
                experts.dequantized_block = scheme.block
                dequantized = experts.down_proj.dtype
                continue
            experts.expect_fp8(device, scheme.block)
            continue
        if scheme.act != "token":
            raise refuse(source, f"quantizes the inputs of {base} per {scheme.act}; float8 experts quantize "
                         "their inputs per token")
        experts.expect_fp8(device)
        quantized.update(names)
    if dequantized is not None:
        log.warning("%s: the block-scaled float8 experts are dequantized to %s at load (on CUDA the MoE kernels "
                    "take blocks whose bk is a multiple of 16): twice their float8 memory, their inputs not rounded",
                    source, dequantized)
    return quantized


def _check_cuda_blocks(block: tuple[int, int], device: torch.device, source: str) -> None:
    # torch's block-wise scaled GEMM (cuBLAS's DeepSeek-style scaling) exists on sm_90 only
    if block != (128, 128):
        raise refuse(source, f"block size {list(block)} runs on CUDA only as [128, 128]")
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0) or not hasattr(F, "scaled_mm"):
        raise refuse(source, f"block-scaled float8 runs on CUDA only on sm_90 (torch's block-wise scaled GEMM); "
                     f"this GPU is sm_{cap[0]}{cap[1]}")


def _make_fp8(m: Linear, scheme: Fp8Scheme, dev: torch.device) -> None:
    n, k = m.weight.shape
    weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=dev), requires_grad=False)
    weight.weight_loader = _load_weight  # type: ignore[attr-defined]
    m.weight = weight
    if scheme.block is not None:
        bn, bk = scheme.block
        shape: tuple[int, ...] = (-(-n // bn), -(-k // bk))
        m.block = scheme.block
    else:
        shape = (n,)
        m.act = scheme.act
    scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=dev), requires_grad=False)
    scale.weight_loader = partial(_load_scale, scheme=scheme)  # type: ignore[attr-defined]
    m.weight_scale = scale


def _load_weight(param: torch.Tensor, tensor: torch.Tensor, start: int, rows: int, what: str) -> None:
    if tensor.dtype != FP8:
        raise ModelLoadError(f"{what} is {tensor.dtype}; the quantization_config makes this layer float8 e4m3")
    if tuple(tensor.shape) != (rows, param.shape[1]):
        raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}, the model expects {(rows, param.shape[1])}")
    param.data.narrow(0, start, rows).copy_(tensor)


def _load_scale(param: torch.Tensor, tensor: torch.Tensor, start: int, rows: int, what: str, *,
                scheme: Fp8Scheme) -> None:
    scale = tensor.float()  # checkpoints store fp32, bf16 or fp16 scales: exact in fp32
    if scheme.block is None:
        # a per-tensor scale fills its shard's rows; a per-channel one is [rows] or [rows, 1]
        want = {(), (1,)} if scheme.weights == "tensor" else {(rows,), (rows, 1)}
        if tuple(scale.shape) not in want:
            raise ModelLoadError(f"{what} has shape {tuple(scale.shape)}; a {scheme.weights} scale of this layer is "
                                 f"{' or '.join(str(w) for w in sorted(want))}")
        param.data.narrow(0, start, rows).copy_(scale.reshape(-1).expand(rows))
        return
    bn = scheme.block[0]
    if start % bn:
        raise ModelLoadError(f"{what}: this shard starts at row {start} of a fused layer, inside a block of {bn} rows")
    want_block = (-(-rows // bn), param.shape[1])
    if tuple(scale.shape) != want_block:
        raise ModelLoadError(f"{what} has shape {tuple(scale.shape)}, block scales of this layer are {want_block}")
    param.data.narrow(0, start // bn, want_block[0]).copy_(scale)


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor, str]], scheme: Fp8Scheme,
                       quantized: set[str]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """The checkpoint's tensors with each scale under our one name (`<layer>.weight_scale`),
    refusing what contradicts the quantization_config: a scale or a float8 weight of a layer
    it keeps unquantized, and tensors of schemes it does not use (static input scales, ...)."""
    for name, tensor, source in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in SCALE_NAMES[scheme.method]:
            if module not in quantized:
                raise ModelLoadError(f"{source}: tensor {name!r} scales a layer the quantization_config does not "
                                     "quantize")
            yield f"{module}.weight_scale", tensor, source
        elif leaf in FOREIGN:
            raise ModelLoadError(f"{source}: tensor {name!r} belongs to a quantization scheme other than the "
                                 f"quantization_config's ({scheme.method}, {scheme.weights} weight scales, dynamic "
                                 "input scales)")
        elif _is_fp8(tensor) and module not in quantized:
            raise ModelLoadError(f"{source}: tensor {name!r} is float8 but the quantization_config keeps {module} "
                                 "unquantized")
        else:
            yield name, tensor, source


def _is_fp8(t: Any) -> bool:
    """A tensor's, or a safetensors slice's (tensor parallelism reads slices), dtype is float8 e4m3."""
    return t.dtype == FP8 if isinstance(t, torch.Tensor) else t.get_dtype() == "F8_E4M3"


def finish(model: nn.Module) -> None:
    """After loading: the block scales in the layout torch's CUDA block-wise GEMM takes."""
    for m in model.modules():
        if isinstance(m, Linear) and m.block is not None and m.weight_scale is not None and m.weight.is_cuda:
            m.cublas_scale = quant.cublas_block_scale(m.weight_scale.data)
