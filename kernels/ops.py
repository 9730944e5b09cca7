"""Dispatch: the Triton kernel for CUDA tensors, the torch reference otherwise.

Signatures and shapes are those of `kernels.reference`.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import reference, reference_moe


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    if _triton(x):
        from kernels import norm

        return norm.rms_norm(x, weight, eps, offset=offset)
    return reference.rms_norm(x, weight, eps, offset)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(x):
        from kernels import norm

        return norm.fused_add_rms_norm(x, residual, weight, eps, offset=offset)
    return reference.fused_add_rms_norm(x, residual, weight, eps, offset)


def rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
    """rms_norm (residual None) or fused_add_rms_norm, with the output's float8 rows and scales
    (quantize_rows_fp8 of it, the same bits): (out, x + residual or None, (q, scales [rows, 1]))."""
    if _triton(x):
        from kernels import norm

        return norm.rms_norm_fp8(x, residual, weight, eps, offset)
    new_res = None
    if residual is None:
        out = reference.rms_norm(x, weight, eps, offset)
    else:
        out, new_res = reference.fused_add_rms_norm(x, residual, weight, eps, offset)
    return out, new_res, reference.quantize_rows_fp8(out.reshape(-1, out.shape[-1]))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _triton(x):
        from kernels import activation

        return activation.silu_and_mul(x)
    return reference.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _triton(x):
        from kernels import activation

        return activation.gelu_tanh_and_mul(x)
    return reference.gelu_tanh_and_mul(x)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(x):
        from kernels import quant

        return quant.quantize_rows_fp8(x)
    return reference.quantize_rows_fp8(x)


def act_and_mul_fp8(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """silu_and_mul (gelu: gelu_tanh_and_mul) with the product's float8 rows and scales
    (quantize_rows_fp8 of it, the same bits): (product, (q, scales [rows, 1]))."""
    if _triton(x):
        from kernels import activation

        return activation.gated_fp8(x, gelu)
    h = reference.gelu_tanh_and_mul(x) if gelu else reference.silu_and_mul(x)
    return h, reference.quantize_rows_fp8(h.reshape(-1, h.shape[-1]))


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(q):
        from kernels import rope

        return rope.rotary(q, k, positions, cos_sin)
    return reference.rotary(q, k, positions, cos_sin)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if _triton(k):
        from kernels import kv_store

        kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """rotary(q, k), then store_kv of the rotated k and v; returns the rotated q (one Triton
    launch on the GPU, for caches in q's dtype or in float8). qk_norm: (q weight, k weight,
    eps, offset): q and k RMS-normalized per head first."""
    if _triton(q) and k_cache.dtype in (q.dtype, torch.float8_e4m3fn):
        from kernels import rope

        return rope.rotary_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm)
    if qk_norm is not None:
        qn, kn, eps, offset = qk_norm
        q = rms_norm(q.reshape(-1, q.shape[-1]), qn, eps, offset).view(q.shape)
        k = rms_norm(k.reshape(-1, k.shape[-1]), kn, eps, offset).view(k.shape)
    q, k = rotary(q, k, positions, cos_sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    tiles: torch.Tensor | None = None,
    block_m: int = 0,
    num_decodes: int = 0,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    split_batch: int | None = None,
    sinks: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """max_q_len is known on the host; 1 selects the split-KV decode kernel (split_batch and
    max_seq_len: see `kernels.attention.paged_decode`). tiles and
    block_m (a CUDA-graph step's tile list) only shape the Triton extend kernel's grid.
    num_decodes: the first sequences have one query each and go through the decode kernel,
    the rest through the extend kernel (a mixed step: the extend kernel reads a sequence's
    pages once per query head, the decode kernel once per KV head). out: where to write
    (rows of a larger tensor; by default a new tensor like q). window, softcap: sliding-window
    attention and score soft-capping, as in `kernels.reference.paged_attention` (0: off);
    sinks: float32 [H] attention sinks (gpt-oss), likewise (None: off)."""
    batch = seq_lens.shape[0]
    if 0 < num_decodes < batch:
        nd = num_decodes
        out = torch.empty_like(q) if out is None else out
        # each kernel writes its rows of `out` in place (copying them in cost 2 x 17 us per
        # layer of a W3 mixed step)
        paged_attention(q[:nd], k_cache, v_cache, page_table[:nd], seq_lens[:nd], cu_q_lens[: nd + 1], scale, 1,
                        out=out[:nd], window=window, softcap=softcap, sinks=sinks, max_seq_len=max_seq_len)
        paged_attention(q[nd:], k_cache, v_cache, page_table[nd:], seq_lens[nd:], cu_q_lens[nd:] - nd, scale,
                        max_q_len, out=out[nd:], window=window, softcap=softcap, sinks=sinks)
        return out
    if _triton(q):
        from kernels import attention

        if max_q_len == 1:
            return attention.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, out=out,
                                          window=window, softcap=softcap, split_batch=split_batch, sinks=sinks,
                                          max_seq_len=max_seq_len)
        return attention.paged_extend(
            q, k_cache, v_cache, page_table, seq_lens, cu_q_lens, scale, max_q_len,
            block_m=block_m or None, tiles=tiles, out=out, window=window, softcap=softcap, sinks=sinks,
        )
    o = reference.paged_attention(
        q, k_cache, v_cache, page_table, seq_lens, cu_q_lens, scale, window, softcap, sinks=sinks
    )
    if out is None:
        return o
    out.copy_(o)
    return out


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = reference.SWIGLU_ALPHA,
    swiglu_limit: float = reference.SWIGLU_LIMIT,
    block: tuple[int, int] | None = None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """kernels.reference_moe.fused_moe (activation "silu", "gelu_tanh" or gpt-oss's "swigluoai";
    optional float8 scales, per row or per [bn, bk] block with `block`, and expert biases).
    x_rows: quantize_rows_fp8(x) where the caller has it already (rms_norm_fp8): per-row float8
    experts then take it instead of quantizing x again (the same bits, so the reference, which
    quantizes x itself, needs none)."""
    kw: dict[str, Any] = {
        "w_gate_up_scale": w_gate_up_scale, "w_down_scale": w_down_scale,
        "w_gate_up_bias": w_gate_up_bias, "w_down_bias": w_down_bias,
        "swiglu_alpha": swiglu_alpha, "swiglu_limit": swiglu_limit, "block": block,
    }  # fmt: skip
    if _triton(x):
        from kernels import moe, moe_gemv

        if moe_gemv.use_gemv(x.shape[0]):  # a few tokens: no alignment, the slots summed in the kernel
            return moe_gemv.moe_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, activation, x_rows=x_rows, **kw)
        return moe.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation, x_rows=x_rows, **kw)
    return reference_moe.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation, **kw)


def route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router: route_topk(F.linear(x, weight), ...); a few tokens on the GPU in one kernel."""
    if _triton(x):
        from kernels import moe_gemv, moe_route

        if moe_gemv.use_gemv(x.shape[0]):
            return moe_route.route(x, weight, top_k, renormalize, round_to)
    return route_topk(torch.nn.functional.linear(x, weight), top_k, renormalize, round_to)


def norm_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    top_k: int, renormalize: bool, round_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(x, residual, norm_weight, eps) then `route` of the normalized rows:
    (weights, ids, normalized rows, x + residual); a few tokens on the GPU in one kernel."""
    if _triton(x):
        from kernels import moe_gemv, moe_route

        if moe_gemv.use_gemv(x.shape[0]):
            return moe_route.norm_route(x, residual, norm_weight, eps, weight, top_k, renormalize, round_to)
    normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return (*route(normed, weight, top_k, renormalize, round_to), normed, residual)


def norm_route_fp8(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    top_k: int, renormalize: bool, round_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """norm_route and the normalized rows' float8 rows and scales (quantize_rows_fp8 of them, the
    same bits), for float8 experts: (weights, ids, normalized rows, x + residual, (q, scales))."""
    if _triton(x):
        from kernels import moe_gemv, moe_route

        if moe_gemv.use_gemv(x.shape[0]):
            return moe_route.norm_route_fp8(x, residual, norm_weight, eps, weight, top_k, renormalize, round_to)
    normed, residual, rows = rms_norm_fp8(x, residual, norm_weight, eps)
    assert residual is not None
    return (*route(normed, weight, top_k, renormalize, round_to), normed, residual, rows)


def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(logits):
        from kernels import moe_route

        return moe_route.route_topk(logits, top_k, renormalize, round_to)
    return reference_moe.route_topk(logits, top_k, renormalize, round_to)


def fused_moe_int4(x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   down: tuple[torch.Tensor, torch.Tensor, torch.Tensor], groups: tuple[int, int], topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, activation: str = "silu",
                   perms: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fused_moe with int4 experts (kernels/moe_int4.py: (qweight, scales, zeros) stacked per
    projection, `groups` columns per scale of each, perms: each expert's act order): the
    dequantized experts' reference semantics."""
    from kernels import moe_int4

    if _triton(x):
        return moe_int4.fused_moe_int4(x, gate_up, down, groups, topk_weights, topk_ids, activation, perms=perms)
    return moe_int4.reference(x, gate_up, down, groups, topk_weights, topk_ids, activation, perms)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                per_row: bool = False) -> torch.Tensor:
    """W4A16: x @ W^T with W in kernels/int4.py's layout (per_row: each row as decode's one)."""
    from kernels import int4

    if _triton(x):
        return int4.linear(x, qweight, scales, zeros, group, per_row)
    return int4.reference_linear(x, qweight, scales, zeros, group)
