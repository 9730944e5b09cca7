"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): a mixture of experts with DeepSeek-V3's router
and a shared expert, on a Llama decoder with partial rotary (transformers 5.24's
modeling_glm4_moe.py).

- Router (`GroupedRouter`, kernels.reference_moe.route_grouped): float32 logits from a float32
  weight (transformers keeps gate.weight and e_score_correction_bias in float32), sigmoid
  scores, experts chosen on scores + e_score_correction_bias within the topk_group best of
  n_group groups, weighted by their scores (renormalized with norm_topk_prob) times
  routed_scaling_factor.
- Every layer from first_k_dense_replace on is sparse; the ones before keep the dense MLP
  of intermediate_size. A sparse layer adds n_shared_experts experts' worth of dense MLP
  (moe_intermediate_size * n_shared_experts, `mlp.shared_experts`, ungated) to the routed
  output.
- Attention: q/k/v biases from attention_bias (o_proj none), per-head q/k RMSNorm with
  use_qk_norm, rotary on the first partial_rotary_factor of each head (default 0.5).
- The checkpoint's multi-token-prediction layers (model.layers.N for N >=
  num_hidden_layers, num_nextn_predict_layers of them) are skipped, as transformers does.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.reference_moe import route_grouped
from streamer.model.layers import MLP
from streamer.model.moe import MoEForCausalLM, SparseMoE


class GroupedRouter(nn.Module):
    float32 = True
    """Kept in float32 whatever the model's dtype (the loader casts it back)."""

    def __init__(self, hidden: int, experts: int, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                 scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scale = renormalize, scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return route_grouped(logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                             self.renormalize, self.scale)


class SharedExpertsMoE(SparseMoE):
    """The routed experts (GroupedRouter) plus the shared experts' dense MLP, summed in the
    hidden dtype (transformers' Glm4MoeMoE)."""

    def __init__(self, cfg: Any, intermediate: int, experts: int, act: str, shared_intermediate: int) -> None:
        top_k = int(cfg.num_experts_per_tok)
        super().__init__(cfg.hidden_size, intermediate, experts, top_k, bool(cfg.norm_topk_prob), False, act)
        self.gate = GroupedRouter(cfg.hidden_size, experts, top_k, int(cfg.n_group), int(cfg.topk_group),
                                  bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor))
        self.shared_experts = MLP(cfg.hidden_size, shared_intermediate, act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class Glm4MoeForCausalLM(MoEForCausalLM):
    experts_field = "n_routed_experts"
    partial_rotary = True

    @property
    def qk_norm(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.config, "use_qk_norm", False))

    def attention_biases(self) -> tuple[bool, bool]:
        return bool(getattr(self.config, "attention_bias", False)), False

    def is_sparse(self, i: int) -> bool:
        return i >= int(self.config.first_k_dense_replace)

    def renormalize(self) -> bool:
        return bool(self.config.norm_topk_prob)

    def shared_intermediate(self) -> int:
        return int(self.config.moe_intermediate_size) * int(self.config.n_shared_experts)

    def make_mlp(self, i: int) -> nn.Module | None:
        if not self.is_sparse(i):
            return None
        return SharedExpertsMoE(self.config, self.expert_intermediate(), self.num_experts(), self.act,
                                self.shared_intermediate())

    def skips_tensor(self, name: str) -> bool:
        return is_mtp_layer(name, int(self.config.num_hidden_layers))


def is_mtp_layer(name: str, num_hidden_layers: int) -> bool:
    """Whether a checkpoint tensor is a multi-token-prediction layer's (model.layers.N, N >=
    num_hidden_layers: GLM-4.5's and DeepSeek-V3's, which transformers skips)."""
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= num_hidden_layers
