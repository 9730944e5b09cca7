"""IBM Granite 3 (GraniteForCausalLM): the Llama decoder with four scalars (transformers'
modeling_granite.py): embeddings times embedding_multiplier, each attention and MLP output
times residual_multiplier before its residual add, attention_multiplier as the softmax scale
(instead of head_dim ** -0.5), and logits divided by logits_scaling."""

from __future__ import annotations

import torch
from torch import nn

from streamer.model.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, *args, residual_multiplier: float, attention_multiplier: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.self_attn.scale = attention_multiplier
        self.residual_multiplier = residual_multiplier

    def forward(self, positions, x, residual, cos_sin):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, i: int) -> nn.Module:
        cfg = self.config
        return GraniteDecoderLayer(
            i, cfg, self.head_dim, self.attention_biases(), self.qk_norm, self.windows[i], self.act, self.make_mlp(i),
            residual_multiplier=float(cfg.residual_multiplier), attention_multiplier=float(cfg.attention_multiplier),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * float(self.config.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / float(self.config.logits_scaling)
