"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

- RMSNorm x * (1 + w) in float32 (norm offset 1.0), and four norms per layer: after
  attention and after the MLP too, each before its residual add.
- GeGLU MLP (hidden_activation, "gelu_pytorch_tanh").
- embeddings times sqrt(hidden_size), rounded to the model's dtype first (as transformers).
- attention scale query_pre_attn_scalar ** -0.5; sliding_attention layers use
  sliding_window (windows.layer_windows).
- Gemma 2: scores soft-capped (attn_logit_softcapping) and logits too
  (final_logit_softcapping, in compute_logits, on every path that makes logits).
- Gemma 3: q/k RMSNorm (offset 1.0) before rotary, and a rotary table per layer type
  (rope_parameters["sliding_attention"] / ["full_attention"]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.model.layers import MLP, Attention, RMSNorm
from streamer.model.llama import LlamaForCausalLM
from streamer.model.rope import rope_cos_sin


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, layer: int, cfg: Any, head_dim: int, window: int, qk_norm: bool, softcap: float, act: str
    ) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(
            layer,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            bool(cfg.attention_bias),
            eps if qk_norm else None,
            window=window,
            softcap=softcap,
            scale=cfg.query_pre_attn_scalar**-0.5,
            norm_offset=1.0,
            o_bias=bool(cfg.attention_bias),
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)

    def forward(self, positions, x, residual, cos_sin):
        """x: the previous layer's MLP output (post-norm), added to residual here, as the
        next layer's input norm is fused with that add."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, cos_sin))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    norm_offset = 1.0
    act_field = "hidden_activation"
    attn_softcap = True
    """Gemma 2 caps attention scores; transformers' Gemma 3 does not read
    attn_logit_softcapping (config_check refuses a Gemma 3 config that sets it)."""

    def __init__(self, cfg: Any, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        # a buffer, so model.to(dtype) rounds it as transformers' `embed_scale.to(weight.dtype)`
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)

    def make_layer(self, i: int) -> nn.Module:
        cap = float(getattr(self.config, "attn_logit_softcapping", None) or 0.0) if self.attn_softcap else 0.0
        return GemmaDecoderLayer(i, self.config, self.head_dim, self.windows[i], self.qk_norm, cap, self.act)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    attn_softcap = False

    def rope_tables(self, max_positions: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        cfg = self.config
        tables = {
            "cos_sin": rope_cos_sin(cfg, self.head_dim, max_positions, "full_attention"),
            "cos_sin_local": rope_cos_sin(cfg, self.head_dim, max_positions, "sliding_attention"),
        }
        names = ["cos_sin_local" if t == "sliding_attention" else "cos_sin" for t in cfg.layer_types]
        return tables, names
