"""AllenAI's OLMo 2 and 3 (Olmo2ForCausalLM, Olmo3ForCausalLM) and OLMoE (OlmoeForCausalLM),
as transformers 5.24 computes them:

- q and k are RMS-normalized over their whole projections (all heads at once, weights of
  num_heads * head_dim), before rotary (`FullNormAttention`); OLMoE then clamps q, k and v
  to +-clip_qkv when it is set.
- OLMo 2/3 put the norms after each sublayer: h = x + post_attention_layernorm(attn(x)),
  then h + post_feedforward_layernorm(mlp(h)), no norm before either (`PostNormLayer`).
  OLMo 3 slides the layers that layer_types says, with a rope per layer type.
- OLMoE is pre-norm, every layer a mixture of num_experts (softmax top-k, renormalized with
  norm_topk_prob, weights in the hidden dtype).

A norm over all heads is not split by heads, so tensor parallelism refuses these."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.model.layers import MLP, Attention, RMSNorm
from streamer.model.llama import LlamaForCausalLM
from streamer.model.moe import MoEForCausalLM
from streamer.model.rope import rope_cos_sin


class FullNormAttention(Attention):
    def __init__(self, layer: int, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool,
                 qk_norm_eps: float | None, *, clip: float | None = None, **kw: Any) -> None:
        # (qk_norm_eps: the eps of the whole-projection norms; no per-head ones)
        assert qk_norm_eps is not None, "the models of FullNormAttention set qk_norm"
        super().__init__(layer, hidden, heads, kv_heads, head_dim, qkv_bias, None, **kw)
        eps = qk_norm_eps
        self.q_norm = RMSNorm(self.q_size, eps)
        self.k_norm = RMSNorm(self.kv_size, eps)
        self.clip = clip

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip is not None:
            q, k, v = (a.clamp(-self.clip, self.clip) for a in (q, k, v))
        return (q.reshape(t, self.heads, self.head_dim), k.reshape(t, self.kv_heads, self.head_dim),
                v.reshape(t, self.kv_heads, self.head_dim), None)


class PostNormLayer(nn.Module):
    """OLMo 2's layer, in the decoder's (x, residual) protocol: the incoming x is the last
    sublayer's normalized output and residual the stream before it (None: x is the
    embedding); the outgoing pair is summed by the next layer or the final norm."""

    def __init__(self, attention: Attention, cfg: Any, act: str) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = attention
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, x, residual, cos_sin):
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, cos_sin))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # (whole projections: FullNormAttention)

    def attention(self, *args: Any, **kw: Any) -> Attention:
        return FullNormAttention(*args, **kw)

    def make_layer(self, i: int) -> nn.Module:
        return PostNormLayer(self.make_attention(i), self.config, self.act)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def rope_tables(self, max_positions: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        """One table per layer type (rope_parameters is keyed by them)."""
        types = list(self.config.layer_types)
        tables = {f"cos_sin_{t}": rope_cos_sin(self.config, self.head_dim, max_positions, t) for t in sorted(set(types))}
        return tables, [f"cos_sin_{t}" for t in types]


class OlmoeForCausalLM(MoEForCausalLM):
    qk_norm = True  # (whole projections: FullNormAttention)
    intermediate_field = "intermediate_size"

    def attention(self, *args: Any, **kw: Any) -> Attention:
        return FullNormAttention(*args, clip=getattr(self.config, "clip_qkv", None), **kw)

    def renormalize(self) -> bool:
        return bool(self.config.norm_topk_prob)
