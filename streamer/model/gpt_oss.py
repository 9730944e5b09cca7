"""OpenAI's gpt-oss (GptOssForCausalLM), as transformers 5.24 computes it:

- attention with q/k/v/o biases and a learned sink per query head (`Attention(sinks=True)`:
  one more logit in each row's softmax, kernels.reference.paged_attention); the layers
  alternate sliding (sliding_window) and full attention as layer_types says; YaRN rotary.
- every layer a mixture of num_local_experts: the router is a linear layer with a bias, the
  top k of its logits softmaxed (the weights rounded to the hidden dtype); each expert has
  biases on both projections and the clamped SwiGLU (up + 1) * g * sigmoid(alpha g), g and
  up clamped by swiglu_limit (kernels.ops.fused_moe "swigluoai").

Checkpoints store each layer's experts stacked, transposed and with gate and up interleaved
(mlp.experts.gate_up_proj [E, H, 2I]: column 2i is gate row i, column 2i + 1 up row i;
down_proj [E, I, H]); they are copied into our [E, 2I, H] (gate rows, then up rows) and
[E, H, I] as they load. The released checkpoints quantize the experts to MXFP4
(quantization_config quant_method "mxfp4": mlp.experts.*_blocks and *_scales): those are
dequantized into the model's dtype at load (dequantize_mxfp4), like transformers with
Mxfp4Config(dequantize=True), so they take 2 bytes per weight in memory.

In bf16 one rounding differs: transformers' norm multiplies its weight in float32, this
RMSNorm in the model's dtype (float32 runs are exact). Tensor parallelism refuses this class
(distributed/checks.py): the sinks and the expert biases are not split.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from streamer.errors import ModelLoadError
from streamer.model.experts import Experts
from streamer.model.layers import Attention
from streamer.model.llama import LlamaForCausalLM
from streamer.model.moe import MoEForCausalLM

log = logging.getLogger(__name__)

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit e2m1 code (its top bit the sign)."""

MXFP4_FIELDS = {"quant_method", "modules_to_not_convert", "dequantize"}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 weights -> [..., rows, 32 * groups] in dtype. blocks: uint8 [..., rows, groups, 16],
    two e2m1 codes per byte (the low nibble first), 32 values per group; scales: uint8
    [..., rows, groups], each group's power of two with a bias of 127 (OCP MX e8m0). Every
    value is exact in bf16 (an e2m1 value times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 blocks and scales are uint8 (got {blocks.dtype} and {scales.dtype})")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                             "(blocks [..., groups, 16], scales [..., groups])")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(lut[codes.long()], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def copy_deinterleaved(target: torch.Tensor, tensor: torch.Tensor, dim: int, what: str) -> None:
    """tensor's [.., gate0, up0, gate1, up1, ..] along dim into target's [.., gate rows .., up rows ..]
    (each half copied in place: no temporary of the whole tensor)."""
    check_shape(target, tensor, what)
    half = target.shape[dim] // 2
    target.narrow(dim, 0, half).copy_(tensor.index_select(dim, torch.arange(0, 2 * half, 2, device=tensor.device)))
    target.narrow(dim, half, half).copy_(tensor.index_select(dim, torch.arange(1, 2 * half, 2, device=tensor.device)))


def check_shape(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)} in streamer's layout (experts' rows "
                             f"are outputs), the model expects {tuple(target.shape)}")


class BiasedRouter(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.empty(experts))


class BiasedExperts(Experts):
    """Experts with a bias on each projection ([E, 2I]: gate then up; [E, H])."""

    def __init__(self, hidden: int, intermediate: int, experts: int) -> None:
        super().__init__(hidden, intermediate, experts)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * intermediate))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))


class GptOssMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.router = BiasedRouter(hidden, experts)
        self.experts = BiasedExperts(hidden, intermediate, experts)
        self.top_k, self.alpha, self.limit = top_k, alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # softmax over the top k logits = the full softmax's top k renormalized (route_topk)
        weights, ids = ops.route_topk(F.linear(x, self.router.weight, self.router.bias), self.top_k, True, x.dtype)
        ex = self.experts
        return ops.fused_moe(x, ex.gate_up_proj, ex.down_proj, weights, ids, "swigluoai",
                             w_gate_up_scale=ex.gate_up_proj_scale, w_down_scale=ex.down_proj_scale,
                             w_gate_up_bias=ex.gate_up_proj_bias, w_down_bias=ex.down_proj_bias,
                             swiglu_alpha=self.alpha, swiglu_limit=self.limit, block=ex.block)


class GptOssForCausalLM(MoEForCausalLM):
    experts_field = "num_local_experts"
    intermediate_field = "intermediate_size"
    int4_experts = False  # (its experts are stored stacked, not one tensor per expert: model/int4_checkpoint.py)

    def __init__(self, cfg: Any, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        qc = getattr(cfg, "quantization_config", None)
        qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
        self.mxfp4 = qc is not None and qc.get("quant_method") == "mxfp4"
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        """An MXFP4 projection's blocks or scales, waiting for the other part."""
        if self.mxfp4:
            log.warning("gpt-oss MXFP4 experts are dequantized to %s at load (2 bytes per weight)",
                        str(self.embed_tokens.weight.dtype).removeprefix("torch."))

    def attention(self, *args: Any, **kw: Any) -> Attention:
        return Attention(*args, sinks=True, **kw)

    def make_mlp(self, i: int) -> nn.Module | None:
        cfg = self.config
        # transformers before ~5.20 has no swiglu_alpha in GptOssConfig: its experts hard-code 1.702
        alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        return GptOssMoE(cfg.hidden_size, self.expert_intermediate(), self.num_experts(), int(cfg.num_experts_per_tok),
                         alpha, float(getattr(cfg, "swiglu_limit", 7.0)))

    def load_expert(self, name: str, tensor: torch.Tensor, what: str) -> set[str] | None:
        m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?", name)
        if m is None or int(m[1]) >= len(self.layers):
            return None
        ex: Any = self.layers[int(m[1])].mlp.experts
        proj, part = m[2], m[3] or ""
        if part in ("_blocks", "_scales"):
            if not self.mxfp4:
                raise ModelLoadError(f"{what}: MXFP4 {part[1:]} in a checkpoint whose config has no "
                                     "quantization_config with quant_method 'mxfp4'")
            key = f"layers.{m[1]}.mlp.experts.{proj}"
            parts = self.pending.setdefault(key, {})
            parts[part] = tensor
            if len(parts) == 2:
                del self.pending[key]
                w = dequantize_mxfp4(parts["_blocks"], parts["_scales"], getattr(ex, proj).dtype)  # [E, out, in]
                if proj == "gate_up_proj":
                    copy_deinterleaved(ex.gate_up_proj.data, w, 1, what)
                else:
                    check_shape(ex.down_proj.data, w, what)
                    ex.down_proj.data.copy_(w)
            return {name}
        target = getattr(ex, proj + part).data
        # biases [E, 2I] (interleaved) and [E, H]; weights [E, H, 2I] (interleaved) and [E, I, H]
        t = tensor if part == "_bias" else tensor.transpose(1, 2)
        if proj == "gate_up_proj":
            copy_deinterleaved(target, t, 1, what)
        else:
            check_shape(target, t, what)
            target.copy_(t)
        return {name}

    def expected_weight_names(self) -> set[str]:
        # (the experts' parameters are named as in the checkpoint: not the dense MLP's shards)
        names = {n for n in LlamaForCausalLM.expected_weight_names(self) if ".mlp.experts." not in n}
        names |= {n for n, _ in self.named_parameters() if ".mlp.experts." in n}
        if self.mxfp4:
            for i in range(len(self.layers)):
                for proj in ("gate_up_proj", "down_proj"):
                    names.discard(f"layers.{i}.mlp.experts.{proj}")
                    names |= {f"layers.{i}.mlp.experts.{proj}_blocks", f"layers.{i}.mlp.experts.{proj}_scales"}
        return names
