"""IBM Granite 3 (GraniteForCausalLM): the Llama decoder with four scalars (transformers'
modeling_granite.py): embeddings times embedding_multiplier, each attention and MLP output
times residual_multiplier before its residual add, attention_multiplier as the softmax scale
(instead of head_dim ** -0.5), and logits divided by logits_scaling."""

from __future__ import annotations

import torch
from torch import nn

from streamer.model.llama import LlamaForCausalLM


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
