"""The router of a mixture of experts on the GPU: its softmax-top-k in one kernel
(`route_topk`), and for a few tokens (moe_gemv.use_gemv) the router's GEMV with its top-k in
one kernel (`route`), which can also take the post-attention add + RMSNorm before it
(`norm_route`). Same semantics as kernels.reference_moe.route_topk."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import prefetch_l2 as _prefetch_l2
from kernels.common import prefetch_lines as _prefetch_lines
from kernels.common import round_to as _round_to
from kernels.moe_gemv import MAX_TOKENS, tile_row, use_gemv
from kernels.quant import empty_rows, quantize_row
from kernels.quant import quantize_rows_fp8 as _quantize_rows_fp8
from kernels.reference import FP8_MAX, FP8_TINY


@triton.jit
def _topk_store(z, offs, valid, weight_ptr, ids_ptr, TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
                RENORM: tl.constexpr, ROUND: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Softmax (fp32) over one token's logits z [BLOCK_E] (valid: the E real ones), the top k
    (of equal probabilities the lower expert id first; torch.topk leaves their order
    unspecified), renormalized to sum 1 (RENORM), rounded to DTYPE (ROUND), stored in order.
    Each pick is one max over int64 keys (the probability's bits, which order as the
    non-negative floats do, above the complement of the id), not a max and then a min."""
    z = z - tl.max(z, axis=0)
    num = tl.where(valid, tl.exp(z), 0.0)
    probs = num / tl.sum(num, axis=0)
    # a row of NaN or infinite logits (hidden states gone non-finite) would pick no real
    # expert, and an id past the experts makes the GEMMs' index ops assert on the device,
    # which ends the whole process. Such a row routes to the lowest experts instead (its
    # output is non-finite anyway).
    probs = tl.where(probs == probs, probs, 0.0)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - offs), -1)
    slots = offs  # (k <= E <= BLOCK_E: the picks kept in a vector of the logits' shape)
    picked = tl.zeros([BLOCK_E], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_E], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(TOPK):
        key = tl.max(keys, axis=0)
        idx = (BLOCK_E - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
        best = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        total += best
        picked = tl.where(slots == j, best, picked)
        picked_ids = tl.where(slots == j, idx, picked_ids)
        keys = tl.where(offs == idx, -1, keys)
    w = picked / total if RENORM else picked
    if ROUND:
        w = _round_to(w, DTYPE, INTERP).to(tl.float32)
    tl.store(weight_ptr + slots, w, mask=slots < TOPK)
    tl.store(ids_ptr + slots, picked_ids, mask=slots < TOPK)


@triton.jit
def _route_kernel(
    logits_ptr,
    weight_ptr,
    ids_ptr,
    E,
    stride_l,
    TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORM: tl.constexpr,
    ROUND: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One token's routing from its logits (`_topk_store`)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    z = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    _topk_store(z, offs, valid, weight_ptr + t * TOPK, ids_ptr + t * TOPK, TOPK, BLOCK_E, RENORM, ROUND, DTYPE, INTERP)


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    count_ptr,
    weight_ptr,
    ids_ptr,
    res_ptr,
    nw_ptr,
    normed_ptr,
    new_res_ptr,
    eps,
    E,
    H,
    stride_x,
    stride_w,
    stride_r,
    stride_n,
    TOPK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORM: tl.constexpr,
    ROUND: tl.constexpr,
    DTYPE: tl.constexpr,
    LOGIT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    NORM: tl.constexpr = False,
    X_DTYPE: tl.constexpr = tl.float32,
    q_ptr=None,
    scale_ptr=None,
    QUANT: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0,
    TINY: tl.constexpr = 1e-12,
    PREFETCH: tl.constexpr = 0,
    W_FIRST: tl.constexpr = False,
):
    """Program (t, r): BLOCK_R router logits of token t (x . W_e, rounded to x's dtype as
    F.linear's output), into the workspace; the last of the token's programs to finish (an
    atomic count, reset by that program for the next call) routes the token (`_topk_store`).

    NORM: x is the attention's output and the router's input is rms_norm(x + residual) with the
    weight at nw_ptr, as kernels/norm.py's fused add + RMSNorm computes it (the sum rounded to
    X_DTYPE, the normalized value to X_DTYPE, times the weight rounded to LOGIT_DTYPE, the
    promoted dtype): every program normalizes the row itself (a row of the hidden size, from L2)
    and program (t, 0) stores it and the sum, for the experts and the next layer. QUANT (H <=
    BLOCK_K: the row in one chunk): program (t, 0) also stores the normalized row's float8 rows
    and scale (kernels/quant.py quantize_row), for float8 experts. W_FIRST (H <= BLOCK_K): the
    program's router rows are loaded before the PDL wait, while the kernel before still runs
    (W2 on the Qwen3-30B-A3B shape: 3.04 against 3.05-3.06 ms/token on an H100)."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    clamped = tl.minimum(rows, E - 1)
    if tl.program_id(0) == 0:  # (the router's weights, once: no kernel before writes them)
        _prefetch_l2(w_ptr + clamped.to(tl.int64) * stride_w, H, PREFETCH)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + clamped[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    if W_FIRST:
        w_first = tl.load(w_ptrs, mask=(offs_k < H)[None, :], other=0.0)
    _pdl_enter(PDL)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    rstd = 0.0
    if NORM:  # the row's statistic first (H > BLOCK_K: a pass over its chunks)
        sq = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k in range(0, H, BLOCK_K):
            mask_k = offs_k < H - k
            xs = tile_row(x_ptr + t * stride_x + k, rows, offs_k, mask_k)
            xs = _round_to(xs + tile_row(res_ptr + t * stride_r + k, rows, offs_k, mask_k), X_DTYPE, INTERP)
            xs = xs.to(tl.float32)
            sq += xs * xs
        rstd = 1.0 / tl.sqrt(tl.max(tl.sum(sq, axis=1), axis=0) / H + eps)  # (every row of the tile: one value)
    for k in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k
        xv = tile_row(x_ptr + t * stride_x + k, rows, offs_k, mask_k)
        if NORM:
            xs = _round_to(xv + tile_row(res_ptr + t * stride_r + k, rows, offs_k, mask_k), X_DTYPE, INTERP)
            nv = tile_row(nw_ptr + k, rows, offs_k, mask_k)
            xn = _round_to(nv * _round_to(xs.to(tl.float32) * rstd, X_DTYPE, INTERP).to(tl.float32), LOGIT_DTYPE,
                           INTERP)
            keep = (rows == 0)[:, None] & mask_k[None, :]  # (program (t, 0)'s first row stores the rows)
            at = k + offs_k[None, :] + (rows * 0)[:, None]
            tl.store(new_res_ptr + t * stride_r + at, xs, mask=keep)
            tl.store(normed_ptr + t * stride_n + at, xn, mask=keep)
            xv = xn.to(tl.float32)
            if QUANT:  # (one chunk: the row's max is in this tile's first row)
                if tl.program_id(1) == 0:
                    row = tl.sum(tl.where(keep, xv, 0.0), axis=0)
                    quantize_row(row, q_ptr + t * H + offs_k, mask_k, scale_ptr + t, FMAX, TINY, INTERP)
        if W_FIRST:
            wv = w_first
        else:
            wv = tl.load(w_ptrs + k, mask=mask_k[None, :], other=0.0)
        acc += wv.to(tl.float32) * xv
    z = _round_to(tl.sum(acc, axis=1), LOGIT_DTYPE, INTERP).to(tl.float32)
    tl.store(logits_ptr + t * BLOCK_E + rows, z, mask=rows < E)
    tl.debug_barrier()  # every thread's logits stored before the count says so
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        tl.store(count_ptr + t, 0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        zs = tl.load(logits_ptr + t * BLOCK_E + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
        _topk_store(zs, offs, valid, weight_ptr + t * TOPK, ids_ptr + t * TOPK, TOPK, BLOCK_E, RENORM, ROUND, DTYPE,
                    INTERP)


def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference_moe.route_topk in one kernel: logits [T, E] -> (weights [T, k] float32,
    ids [T, k] int32)."""
    t, experts = logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    logits = logits.contiguous()
    _route_kernel[(t,)](
        logits, weights, ids, experts, logits.stride(0),
        TOPK=top_k, BLOCK_E=triton.next_power_of_2(experts), RENORM=renormalize,
        ROUND=round_to is not None, DTYPE=_TL_DTYPES[round_to or torch.float32], INTERP=_interpreting(),
        num_warps=1,
    )  # fmt: skip
    return weights, ids


ROUTER_ROWS = 1
ROUTER_K = 2048
ROUTER_WARPS = 4
"""`route`: one router row per program, up to 2,048 columns per load (Qwen3-30B-A3B's whole
row: 128 programs with one load each). 4 rows x 256-column chunks took 10.2 us per layer on
the H200, more than cuBLAS + the top-k kernel (8.0): 8 dependent loads per program."""

_counts: dict[torch.device, torch.Tensor] = {}


def route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None,
    num_warps: int = ROUTER_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """route_topk(F.linear(x, weight), ...) for a few tokens (use_gemv) in one kernel: the
    router's GEMV and the top-k, the last program of each token doing its top-k. Its counts
    live in one zeroed buffer per device, left zeroed by every call, so calls on one device
    must not run concurrently (the engine runs its model on one stream). num_warps: per program
    (tuning: the last program's top-k reduces across them k times)."""
    weights, ids, _, _, _ = _launch(x, weight, top_k, renormalize, round_to, num_warps, None)
    return weights, ids


def norm_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    top_k: int, renormalize: bool, round_to: torch.dtype | None = None, num_warps: int = ROUTER_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.norm.fused_add_rms_norm(x, residual, norm_weight, eps) and then `route` of the
    normalized rows, in one kernel: (weights, ids, the normalized rows, x + residual). A decode
    step of a mixture of experts saves the norm's launch (the router's programs each normalize
    the row they read anyway)."""
    weights, ids, normed, new_res, _ = _launch(x, weight, top_k, renormalize, round_to, num_warps,
                                               (residual, norm_weight, eps))
    return weights, ids, normed, new_res


def norm_route_fp8(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    top_k: int, renormalize: bool, round_to: torch.dtype | None = None, num_warps: int = ROUTER_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """norm_route and the normalized rows' float8 rows and scales (kernels.reference.quantize_rows_fp8's
    bits), for float8 experts: in the same kernel where a row fits one load (ROUTER_K columns),
    else one quantization launch after it."""
    weights, ids, normed, new_res, rows = _launch(x, weight, top_k, renormalize, round_to, num_warps,
                                                  (residual, norm_weight, eps), quant=True)
    return weights, ids, normed, new_res, rows if rows is not None else _quantize_rows_fp8(normed)


def _launch(x, weight, top_k, renormalize, round_to, num_warps, norm, quant=False):
    t, hidden = x.shape
    experts = weight.shape[0]
    assert use_gemv(t) and weight.shape == (experts, hidden)
    counts = _counts.get(x.device)
    if counts is None:
        counts = _counts[x.device] = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=x.device)
    block_e = triton.next_power_of_2(experts)
    logits = torch.empty((t, block_e), dtype=torch.float32, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    x = x.contiguous()
    weight = weight.contiguous()
    if norm is None:
        residual = normed = new_res = norm_weight = x
        eps, in_dtype = 0.0, x.dtype
    else:
        residual, norm_weight, eps = norm
        assert residual.shape == x.shape and norm_weight.shape == (hidden,)
        residual, norm_weight = residual.contiguous(), norm_weight.contiguous()
        in_dtype = torch.promote_types(norm_weight.dtype, x.dtype)  # (the norm's output dtype)
        normed = torch.empty((t, hidden), dtype=in_dtype, device=x.device)
        new_res = torch.empty_like(x)
    block_k = min(ROUTER_K, triton.next_power_of_2(hidden))
    rows = None
    if quant and norm is not None and hidden <= block_k:
        rows = empty_rows(t, hidden, x.device)
    pdl = _pdl_enabled(x)
    _router_kernel[(t, triton.cdiv(experts, ROUTER_ROWS))](
        x, weight, logits, counts, weights, ids, residual, norm_weight, normed, new_res, float(eps),
        experts, hidden, x.stride(0), weight.stride(0), residual.stride(0), normed.stride(0),
        TOPK=top_k, BLOCK_R=ROUTER_ROWS, BLOCK_K=block_k, BLOCK_E=block_e,
        RENORM=renormalize, ROUND=round_to is not None, DTYPE=_TL_DTYPES[round_to or torch.float32],
        LOGIT_DTYPE=_TL_DTYPES[in_dtype], INTERP=_interpreting(), PDL=pdl, NORM=norm is not None,
        X_DTYPE=_TL_DTYPES[x.dtype], q_ptr=x if rows is None else rows[0], scale_ptr=x if rows is None else rows[1],
        QUANT=rows is not None, FMAX=FP8_MAX, TINY=FP8_TINY, PREFETCH=_prefetch_lines(hidden * weight.element_size(), pdl),
        W_FIRST=hidden <= block_k,
        num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return weights, ids, normed, new_res, rows
