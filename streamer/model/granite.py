"""IBM Granite 3 (GraniteForCausalLM, and GraniteMoeForCausalLM with experts): the Llama
decoder with four scalars (transformers' modeling_granite.py): embeddings times
embedding_multiplier, each attention and MLP output times residual_multiplier before its
residual add, attention_multiplier as the softmax scale (instead of head_dim ** -0.5), and
logits divided by logits_scaling."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from streamer.model.llama import LlamaForCausalLM
from streamer.model.moe import MoEForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, i: int) -> nn.Module:
        layer = super().make_layer(i)
        layer.self_attn.scale = float(self.config.attention_multiplier)
        layer.residual_multiplier = float(self.config.residual_multiplier)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * float(self.config.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / float(self.config.logits_scaling)


class GraniteMoeForCausalLM(GraniteForCausalLM, MoEForCausalLM):
    """Granite 3 MoE: Granite's four scalars on a mixture of experts in every layer (top-k of
    num_local_experts, softmax over the k chosen logits, which is the renormalized top k of
    the softmax, rounded to the hidden dtype). Checkpoints stack the experts
    (block_sparse_moe.input_linear [E, 2I, H] gate then up, output_linear [E, H, I], router.layer);
    transformers 5.24's own names (experts.gate_up_proj, experts.down_proj, router.weight)
    load too."""

    int4_experts = False  # (its experts are stored stacked, not one tensor per expert: model/int4_checkpoint.py)

    experts_field = "num_local_experts"
    intermediate_field = "intermediate_size"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        super().load_weights((_granite_moe_name(name), t, source) for name, t, source in weights)


_GRANITE_MOE_NAMES = [
    (re.compile(r"\.block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)$"), ".mlp.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)$"), ".mlp.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router\.(?:layer\.)?weight$"), ".mlp.gate.weight"),
]


def _granite_moe_name(name: str) -> str:
    """A Granite MoE checkpoint name as the stacked-expert names of model/moe.py."""
    for pattern, ours in _GRANITE_MOE_NAMES:
        if pattern.search(name):
            return pattern.sub(ours, name)
    return name
