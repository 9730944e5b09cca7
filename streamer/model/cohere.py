"""Cohere's Command R (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM), as
transformers 5.24 computes them:

- LayerNorm (mean-centred, a weight and no bias, in float32) instead of RMSNorm, before
  each layer and at the end;
- a parallel layer: h = x + attn(norm(x)) + mlp(norm(x)), one norm for both;
- rotary over interleaved pairs (2i, 2i + 1): the loader permutes each q/k head's rows so
  that the kernels' pairs (i, i + head_dim/2) are those (`rotary_permutation`);
- logits times logit_scale; q/k/v/o biases from attention_bias.
- Command R7B / A: layer_types slide 3 layers of 4 (sliding_window), and only the sliding
  layers rotate (the others are NoPE: smollm3.py's cos 1 / sin 0 table).

- use_qk_norm (Command R+): a LayerNorm over each q and k head, with a weight per head
  ([heads, head_dim]), before the rotation (`HeadLayerNorm`); its weights' dims follow the
  rotary permutation, and under tensor parallelism each rank holds its own heads' rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.model.layers import MLP, Attention
from streamer.model.llama import LlamaForCausalLM
from streamer.model.smollm3 import unrotated_table


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' CohereLayerNorm: float32 throughout, one rounding at the end
        xf = x.float()
        centred = xf - xf.mean(-1, keepdim=True)
        return (self.weight.float() * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps))).to(
            x.dtype)


class HeadLayerNorm(LayerNorm):
    """LayerNorm over the last dim of [T, heads, head_dim] with a weight per head
    ([heads, head_dim]): transformers' CohereLayerNorm of a (heads, head_dim) size."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__(head_dim, eps)
        self.weight = nn.Parameter(torch.ones(heads, head_dim))


class CohereAttention(Attention):
    """Attention with Command R+'s per-head q/k LayerNorms (torch ops before rotary_store, which
    applies no norm of its own here)."""

    def __init__(self, *args: Any, qk_layer_norm_eps: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.q_norm = HeadLayerNorm(self.heads, self.head_dim, qk_layer_norm_eps)  # type: ignore[assignment]
        self.k_norm = HeadLayerNorm(self.kv_heads, self.head_dim, qk_layer_norm_eps)  # type: ignore[assignment]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(t, self.heads, self.head_dim), k.reshape(t, self.kv_heads, self.head_dim)
        assert self.q_norm is not None and self.k_norm is not None
        return self.q_norm(q), self.k_norm(k), v.reshape(t, self.kv_heads, self.head_dim), None


class ParallelLayer(nn.Module):
    """Attention and MLP side by side on one norm. The residual stream is the layer's output
    itself (the decoder's residual stays None)."""

    def __init__(self, attention: Attention, hidden: int, intermediate: int, eps: float, act: str) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = MLP(hidden, intermediate, act)
        self.input_layernorm = LayerNorm(hidden, eps)

    def forward(self, positions, x, residual, cos_sin):
        n = self.input_layernorm(x)
        return x + self.self_attn(positions, n, cos_sin) + self.mlp(n), None


class CohereForCausalLM(LlamaForCausalLM):
    def attention(self, *args: Any, **kw: Any) -> Attention:
        if getattr(self.config, "use_qk_norm", False):
            return CohereAttention(*args, qk_layer_norm_eps=float(self.config.layer_norm_eps), **kw)
        return Attention(*args, **kw)

    def make_norm(self) -> nn.Module:
        return LayerNorm(self.config.hidden_size, self.config.layer_norm_eps)

    def make_layer(self, i: int) -> nn.Module:
        cfg = self.config
        return ParallelLayer(self.make_attention(i), cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps,
                             self.act)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer, rope in zip(self.layers, self.layer_rope):
            x, _ = layer(positions, x, None, getattr(self, rope))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * float(self.config.logit_scale)

    def rotary_permutation(self) -> torch.Tensor | None:
        d = self.head_dim
        return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # pair (2i, 2i + 1) -> (i, i + d/2)


class Cohere2ForCausalLM(CohereForCausalLM):
    def rope_tables(self, max_positions: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        tables, _ = super().rope_tables(max_positions)
        names = ["cos_sin" if t == "sliding_attention" else "cos_sin_none" for t in self.config.layer_types]
        return {"cos_sin": tables["cos_sin"], "cos_sin_none": unrotated_table(tables["cos_sin"])}, names

