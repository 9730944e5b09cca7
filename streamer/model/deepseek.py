"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM) and DeepSeek-V3 / R1, Moonlight, Kimi-K2
(DeepseekV3ForCausalLM), as transformers 5.24 computes them (modeling_deepseek_v2.py,
modeling_deepseek_v3.py).

Multi-head latent attention (`MLAttention`), absorbed:
- q = q_proj(x) (q_lora_rank None) or q_b_proj(q_a_layernorm(q_a_proj(x))), per head
  qk_nope_head_dim "nope" dims then qk_rope_head_dim rope dims;
- kv_a_proj_with_mqa(x) = (c, k_rope): c (kv_lora_rank) through kv_a_layernorm is the
  compressed kv, k_rope one rope key shared by all heads;
- kv_b_proj [H * (nope + v_head_dim), kv_lora_rank] holds each head's W_UK (its nope rows)
  and W_UV (its v rows). A score q_nope . (W_UK c) + q_rope . k_rope is (W_UK^T q_nope) . c
  + q_rope . k_rope, and the value W_UV c summed with the weights is W_UV (sum p c): so the
  cache keeps (c, k_rope) per token and layer, kv_lora_rank + qk_rope_head_dim values as one
  "KV head" (PagePool shared_v: V is K's first kv_lora_rank dims), and attention runs in
  that latent space (kernels/mla.py); W_UV and o_proj follow.
- softmax scale (nope + rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 with YaRN
  rope (transformers' yarn_apply_mscale); the YaRN frequencies and attention factor are
  rope.py's (transformers' own ROPE_INIT_FUNCTIONS) on the rope dims.
- rope on interleaved pairs (2i, 2i + 1): V2 always (complex multiplication), V3 with
  rope_interleave (its default); the loader permutes the q rope rows of each head and the
  k_rope rows so the kernels' pairs (i, i + rope/2) are those (q . k is unchanged).
  kv_a_layernorm and q_a_layernorm use eps 1e-6 whatever rms_norm_eps (transformers builds
  them with the default).

Mixture of experts: layers from first_k_dense_replace on are sparse, with
n_shared_experts experts' worth of ungated dense MLP beside the routed experts.
- V2's router (`SoftmaxRouter`): float32 softmax scores; topk_method "greedy" (the top k)
  or "group_limited_greedy" (the top k within the topk_group groups of n_group with the
  highest best score); the chosen scores times routed_scaling_factor, never renormalized
  (transformers' DeepseekV2TopkRouter ignores norm_topk_prob: config_check refuses it true).
- V3's is GLM-4.5's (glm4_moe.SharedExpertsMoE: sigmoid, e_score_correction_bias,
  noaux_tc); its multi-token-prediction layers are skipped (glm4_moe.is_mtp_layer).

Float8 checkpoints (DeepSeek-V3/R1's [128, 128] blocks) load as model/fp8_checkpoint.py
loads any, except kv_b_proj: absorbed attention reads it as two dense matrices per head, so
a float8 (or int4) kv_b_proj is dequantized into the model's dtype once loaded (`LatentProjection`),
and the compressed kv is not rounded to float8 (transformers' float8 layer would quantize
its input c; DeepSeek's own absorbed inference code does not). quantization "fp8" leaves
kv_b_proj in the model's dtype likewise.

Tensor parallelism splits the heads: q_proj / q_b_proj and kv_b_proj (each head's W_UK and
W_UV) by this rank's heads (model/tp_layers.py reads their slices by `tp_head_sizes`), o_proj
row-parallel with its all-reduce. q_a_proj, kv_a_proj_with_mqa and their norms are whole on
every rank: the latent is shared by all heads, so every rank computes and caches all of it
(each rank's pool holds the whole latent of its tokens). The experts, the shared experts and
the dense first layers split as moe.py's do; the routers are whole.

Not supported, refused by name: float8 KV cache (runner.py), a DeepSeek draft model
(draft.py), float8 checkpoints under tensor parallelism (distributed/checks.py, as for every
model).
Attention: kernels/mla.py; on CUDA its Triton kernels (split-KV decode, extend), which
synchronize nothing, so decode and extend steps are captured in CUDA graphs where those
kernels take the dims (power-of-two kv_lora_rank and qk_rope_head_dim: `cuda_graphs_ok`);
elsewhere its torch loop, eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from kernels.mla import paged_mla, store_latent
from streamer.errors import ConfigError, ModelLoadError
from streamer.model import quant
from streamer.model.context import get_context, rows_as_decode
from streamer.model.glm4_moe import SharedExpertsMoE, is_mtp_layer
from streamer.model.int4_linear import Int4Linear
from streamer.model.layers import MLP, Linear, RMSNorm
from streamer.model.moe import MoEForCausalLM, SparseMoE
from streamer.model.rope import rope_params, rope_type
from streamer.model.tp_group import TPGroup
from streamer.model.tp_group import current as tensor_parallel

LATENT_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's (transformers' DeepseekV3RMSNorm default)."""


def softmax_scale(cfg: Any) -> float:
    """transformers' yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5)."""
    scale = (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)) ** -0.5
    params = rope_params(cfg)
    m = params.get("mscale_all_dim", 0)
    if rope_type(params) != "default" and m:
        factor = float(params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(m) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentProjection(Linear):
    """kv_b_proj: its weight is read as two matrices per head (W_UK, W_UV), never run as a
    layer. A Linear, so that a float8 checkpoint's loads through model/fp8_checkpoint.py's
    weight loaders (then `dequantize`); quantization "fp8" leaves it as it is. An int4
    checkpoint's loads into an Int4Linear in its place, dequantized once loaded (`of_int4`)."""

    int4_dequantized = True

    @classmethod
    def of_int4(cls, layer: Int4Linear, dtype: torch.dtype) -> LatentProjection:
        dense = cls(layer.in_features, layer.out_features, bias=False, device=layer.weight.device, dtype=dtype)
        dense.weight = nn.Parameter(layer.dense(dtype), requires_grad=False)
        return dense

    def quantize_fp8(self, split_rows: TPGroup | None = None) -> bool:
        return False

    def dequantize(self, dtype: torch.dtype) -> None:
        """A float8 weight (per-row or block scales) -> the dense weight it stands for, in dtype."""
        if self.weight.dtype != torch.float8_e4m3fn:
            return
        scale = self.weight_scale
        assert scale is not None
        dense = quant.dequantize_blocks(self.weight, scale, self.block) if self.block is not None \
            else self.weight.float() * scale.view(-1, 1)
        self.weight = nn.Parameter(dense.to(dtype), requires_grad=False)
        self.weight_scale, self.block = None, None


class MLAttention(nn.Module):
    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tensor_parallel()
        self.heads = int(cfg.num_attention_heads)
        if self.tp is not None:  # this rank's heads (the latent's projections stay whole)
            self.heads = self.tp.heads(self.heads, self.heads)[0]
        self.nope, self.rope = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        self.rank, self.v_dim = int(cfg.kv_lora_rank), int(cfg.v_head_dim)
        hidden, bias = cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        q_out = self.heads * (self.nope + self.rope)
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, int(self.q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), LATENT_NORM_EPS)
            self.q_b_proj = Linear(int(self.q_lora_rank), q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_rope, k_rope = ops.rotary(q_rope.contiguous(), k_rope.reshape(t, 1, self.rope).contiguous(), positions,
                                    cos_sin)
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        cache = ctx.k_cache[self.layer]
        store_latent(torch.cat((c[:, None, :], k_rope), dim=-1), cache, ctx.slot_mapping)
        o = paged_mla(torch.cat((q_latent, q_rope), dim=-1), cache, ctx.page_table, ctx.seq_lens, ctx.cu_q_lens,
                      self.scale, self.rank, max_q_len=ctx.max_q_len, num_decodes=ctx.num_decodes, tiles=ctx.tiles,
                      block_m=ctx.block_m, split_batch=1 if rows_as_decode() else None)
        out = self.o_proj(torch.einsum("thr,hvr->thv", o, w_uv).reshape(t, self.heads * self.v_dim))
        return out if self.tp is None else self.tp.all_reduce(out)


def route_softmax(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, limited: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router over float32 logits [T, E] (transformers' DeepseekV2TopkRouter):
    softmax scores; with `limited` (group_limited_greedy) the experts outside the topk_group
    groups of highest best score score 0; the top k, times `scale`.
    -> (weights [T, k] float32, ids [T, k] int32)."""
    scores = logits.float().softmax(dim=-1)
    if limited:
        t, e = scores.shape
        best = scores.view(t, n_group, e // n_group).max(dim=-1).values
        keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, dim=-1, sorted=False)[1], 1.0)
        scores = scores.masked_fill(~keep.bool()[:, :, None].expand(t, n_group, e // n_group).reshape(t, e), 0.0)
    weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    return weights * scale, ids.to(torch.int32)


class SoftmaxRouter(nn.Module):
    float32 = True
    """Kept in float32 whatever the model's dtype (transformers' _keep_in_fp32_modules_strict)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(int(cfg.n_routed_experts), cfg.hidden_size))
        self.top_k, self.scale = int(cfg.num_experts_per_tok), float(cfg.routed_scaling_factor)
        self.limited = cfg.topk_method == "group_limited_greedy"
        self.n_group, self.topk_group = int(cfg.n_group or 1), int(cfg.topk_group or 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_softmax(F.linear(x.float(), self.weight), self.top_k, self.n_group, self.topk_group,
                             self.limited, self.scale)


class SoftmaxSharedMoE(SparseMoE):
    """DeepSeek-V2's block: SoftmaxRouter's experts plus the shared experts' dense MLP."""

    def __init__(self, cfg: Any, act: str) -> None:
        top_k = int(cfg.num_experts_per_tok)
        inter = int(cfg.moe_intermediate_size)
        super().__init__(cfg.hidden_size, inter, int(cfg.n_routed_experts), top_k, False, False, act)
        self.gate = SoftmaxRouter(cfg)  # type: ignore[assignment]
        self.shared_experts = MLP(cfg.hidden_size, inter * int(cfg.n_shared_experts), act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """head_dim is qk_rope_head_dim (the config's own: the rotary table's width)."""

    experts_field = "n_routed_experts"
    rope_interleaved = True

    @property
    def cuda_graphs_ok(self) -> bool:
        """The MoE's Triton kernels (moe.py's condition) and latent attention's: kernels/mla.py's
        torch loop, which runs for dims its kernels do not take, synchronizes on the lengths."""
        from kernels.mla_decode import supported_dims

        cfg = self.config
        return super().cuda_graphs_ok and supported_dims(int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim),
                                                         self.embed_tokens.weight.dtype)

    def __init__(self, cfg: Any, max_positions: int) -> None:
        tp = tensor_parallel()
        if tp is not None and int(cfg.num_attention_heads) % tp.size:
            raise ConfigError(f"{type(self).__name__}: tensor_parallel_size={tp.size} must divide the number of "
                              f"attention heads ({cfg.num_attention_heads})")
        super().__init__(cfg, max_positions)
        self.latent_cache = (int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim), int(cfg.kv_lora_rank))
        """(values per token and layer, the first of them that are V): the PagePool's layout."""
        nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
        self.tp_head_sizes = {"q_proj": nope + rope, "q_b_proj": nope + rope, "kv_b_proj": nope + v, "o_proj": v}
        """Rows per head of the projections split by heads (o_proj: columns), for model/tp_layers.py."""

    def shared_intermediate(self) -> int:
        """The shared experts' dense MLP (tensor parallelism splits it as a dense MLP)."""
        return int(self.config.moe_intermediate_size) * int(self.config.n_shared_experts)

    def make_attention(self, i: int) -> MLAttention:  # type: ignore[override]
        return MLAttention(self.config, i)

    def is_sparse(self, i: int) -> bool:
        return i >= int(self.config.first_k_dense_replace or 0)

    def make_mlp(self, i: int) -> nn.Module | None:
        return SoftmaxSharedMoE(self.config, self.act) if self.is_sparse(i) else None

    def fused_module(self, name: str) -> str:
        """q_proj is a layer of its own here (no k or v projection to fuse it with)."""
        return name if name.endswith(".self_attn.q_proj") else super().fused_module(name)

    def load_expert(self, name: str, tensor: torch.Tensor, what: str) -> set[str] | None:
        """Also self_attn.q_proj's weight (and a float8 checkpoint's scale), which the Llama loader
        would take for a shard of its fused qkv_proj."""
        if ".self_attn.q_proj." in name:
            param = self.get_parameter(name)
            loader = getattr(param, "weight_loader", None)
            if loader is not None:  # (model/fp8_checkpoint.py's)
                loader(param, tensor, 0, self.get_submodule(name.rsplit(".", 1)[0]).out_features, what)
                return {name}
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"{what} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            return {name}
        return super().load_expert(name, tensor, what)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        super().load_weights(weights)
        if self.rope_interleaved:
            self._deinterleave_rope()

    def loaded(self) -> None:
        for layer in self.layers:  # (dummy weights too: a float8 config's kv_b_proj is float8 either way)
            attn: Any = layer.self_attn
            if isinstance(attn.kv_b_proj, Int4Linear):
                attn.kv_b_proj = LatentProjection.of_int4(attn.kv_b_proj, self.norm.weight.dtype)
            attn.kv_b_proj.dequantize(self.norm.weight.dtype)

    def _deinterleave_rope(self) -> None:
        """Each q head's rope rows and the k_rope rows from pairs (2i, 2i + 1) to (i, i + rope/2)."""
        cfg = self.config
        nope, rope, rank = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.kv_lora_rank)
        perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        head = torch.cat([torch.arange(nope), nope + perm])  # (the nope rows stay)
        for layer in self.layers:
            attn: Any = layer.self_attn
            q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
            q.permute_rows((torch.arange(attn.heads)[:, None] * (nope + rope) + head[None, :]).view(-1))
            attn.kv_a_proj_with_mqa.permute_rows(torch.cat([torch.arange(rank), rank + perm]))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's attention (rope_interleave: whether the rope dims pair up interleaved), GLM-4.5's
    router and shared experts, the multi-token-prediction layers skipped."""

    @property
    def rope_interleaved(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.config, "rope_interleave", True))

    def make_mlp(self, i: int) -> nn.Module | None:
        if not self.is_sparse(i):
            return None
        cfg = self.config
        inter = int(cfg.moe_intermediate_size)
        return SharedExpertsMoE(cfg, inter, int(cfg.n_routed_experts), self.act, inter * int(cfg.n_shared_experts))

    def skips_tensor(self, name: str) -> bool:
        return is_mtp_layer(name, int(self.config.num_hidden_layers))


def check_deepseek(cfg: Any, cls: type[DeepseekV2ForCausalLM], refuse: Any) -> None:
    """config_check's part for these classes: the values transformers' classes ignore or
    compute otherwise than DeepSeek's own code, refused by name."""
    v3 = issubclass(cls, DeepseekV3ForCausalLM)
    if getattr(cfg, "head_dim", None) != cfg.qk_rope_head_dim:
        refuse("head_dim", f"transformers' rotary tables are head_dim wide; the rope dims are qk_rope_head_dim "
                           f"({cfg.qk_rope_head_dim})")
    if int(cfg.num_key_value_heads) != int(cfg.num_attention_heads):
        refuse("num_key_value_heads", "multi-head latent attention has one key per query head "
                                      f"(num_attention_heads {cfg.num_attention_heads})")
    if int(getattr(cfg, "moe_layer_freq", 1) or 1) != 1:
        refuse("moe_layer_freq", "transformers' class makes every layer from first_k_dense_replace sparse")
    scoring = getattr(cfg, "scoring_func", None)
    if scoring is not None and scoring != ("sigmoid" if v3 else "softmax"):
        refuse("scoring_func", f"{cls.__name__} scores experts with {'sigmoid' if v3 else 'softmax'}")
    method = getattr(cfg, "topk_method", None)
    experts, k = int(cfg.n_routed_experts), int(cfg.num_experts_per_tok)
    if v3:
        if method not in (None, "noaux_tc"):
            refuse("topk_method", "DeepseekV3ForCausalLM routes with noaux_tc")
        groups, best = cfg.n_group, cfg.topk_group
    else:
        if method not in ("greedy", "group_limited_greedy"):
            refuse("topk_method", "DeepseekV2ForCausalLM routes with greedy or group_limited_greedy")
        if cfg.norm_topk_prob:
            refuse("norm_topk_prob", "transformers' DeepseekV2TopkRouter never renormalizes the top k")
        groups, best = (cfg.n_group, cfg.topk_group) if method == "group_limited_greedy" else (1, 1)
    if not isinstance(groups, int) or groups < 1 or experts % groups or (v3 and groups > 1 and experts // groups < 2):
        refuse("n_group", f"must divide the {experts} routed experts into equal groups")
    if not isinstance(best, int) or not 1 <= best <= groups or best * (experts // groups) < k:
        refuse("topk_group", f"must be between 1 and n_group ({groups}), its groups holding num_experts_per_tok")
    if int(getattr(cfg, "n_shared_experts", 0) or 0) < 1:
        refuse("n_shared_experts", f"{cls.__name__} is built with at least one shared expert")
