"""The mixture-of-experts MLP for a few tokens (decode): `moe_gemv`, the semantics of
kernels.reference_moe.fused_moe (the router's kernels for a few tokens: kernels/moe_route.py).

Why apart from kernels/moe.py: at batch 1 a Qwen3-30B-A3B layer routes 8 (token, slot)
pairs to 8 experts. The grouped GEMM there first aligns the pairs by expert (three small
kernels) and runs M-blocks of 16 rows holding one valid row each: 35.5 us for the layer on
the H200 against 23.6 here, where each (token, slot) pair p reads its expert's rows straight
from topk_ids (no alignment), as the dense GEMV (kernels/gemv) does:

    GEMM 1: program (p, n-block):  inter[p, n] = act(x[p // k] . Wg_e[n]) * (x[p // k] . Wu_e[n])
    GEMM 2: program (t, n-block):  out[t, n] = sum_j w[t, j] * (inter[t*k + j] . Wd_e[n]),  e = ids[t, j]

GEMM 2 holds the k slots of a token in one tile (rows (slot, n)), so the weighted sum over
slots (float32) and the cast to x's dtype happen in its epilogue: two kernels per layer (the
grouped GEMM's alignment and combine make five). Two tokens routed to one expert each stream
its rows (the grouped GEMM shares them): that is
why this path is for a few tokens only (`use_gemv`).

Rounding as the reference: gate and up products, the activation and its product with up,
and each slot's down product are rounded to x.dtype; the routing weight and the sum over
slots are float32. Expert biases (gpt-oss) are added to the rounded products in the
epilogues, the sums rounded again; gpt-oss's clamped SwiGLU rounds after each of its steps
(kernels.activation.swigluoai).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.activation import moe_glu
from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import prefetch_l2 as _prefetch_l2
from kernels.common import prefetch_lines as _prefetch_lines
from kernels.common import round_to as _round_to
from kernels.moe_operands import (
    act_constants,
    bias_operand,
    fp8_operands,
    group_tile,
    quantize_groups,
    quantize_rows,
)

MAX_TOKENS = 16
"""Tokens up to which `moe_gemv` replaces the grouped GEMM (measured on the H200 for the
Qwen3-30B-A3B layer, benchmarks/moe_layer.py: faster up to 16 tokens, slower at 32)."""

BLOCK_N = 2
BLOCK_K = 256
UNROLL = 2
"""GEMM 1: 2 gate rows (and their 2 up rows) x 256 columns per chunk with 4 warps, UNROLL chunks
loaded per iteration. On the H200 (benchmarks/moe_layer.py, Qwen3-30B-A3B layer, 2026-12-03)
2 rows beat 4 and 8 at 1 and 4 tokens (25.1 against 26.7 us for the whole layer at 1): more
programs in flight."""

DOWN = (4, 128, 2, 8)
"""GEMM 2's (block_n, block_k, unroll, num_warps): 4 output rows x the k slots per program
(32 W rows at top-8), 128-column chunks two at a time, 8 warps: the fastest of eight
variants at 1 and 4 tokens (25.1 and 75.9 us for the layer, against 26.7 and 81.2 for 256 x 1)."""


def use_gemv(tokens: int) -> bool:
    return 0 < tokens <= MAX_TOKENS


@triton.jit
def tile_row(row_ptr, offs_n, offs_k, mask_k):
    """A row of K values loaded in the [BLOCK_N, BLOCK_K] layout of the W tile (rows share
    addresses: L1 hits), as fp32: no re-layout through shared memory per chunk."""
    ptrs = row_ptr + offs_k[None, :] + (offs_n * 0)[:, None]
    return tl.load(ptrs, mask=mask_k[None, :], other=0.0).to(tl.float32)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    sx_ptr,
    sw_ptr,
    bias_ptr,
    H,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    up_off,
    stride_o,
    stride_se,
    stride_sn,
    stride_sx,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    """inter[p, n] = moe_glu(x[p // k] . Wg_e[n] + bg_e[n], x[p // k] . Wu_e[n] + bu_e[n]) for
    BLOCK_N rows n, e = ids[p] (the biases [E, 2I] with HAS_BIAS). Float8 (SCALED): per-row
    scales, or with GROUP_K (> 0) [GROUP_N, GROUP_K] block scales (kernels/moe.py's layout)."""
    _pdl_enter(PDL)  # (ids and x come from the kernels before)
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, INTER - 1)  # tail rows re-read row INTER-1; the store masks them
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (p // TOPK) * stride_x
    g_ptrs = w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    sg_ptrs = sw_ptr + expert * stride_se + (rows // GROUP_N) * stride_sn  # (block scales: the
    su_ptrs = sg_ptrs + tl.cdiv(INTER, GROUP_N) * stride_sn  # up rows' grid after the gate's)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):  # UNROLL chunks' loads in flight at once
            k = k0 + u * BLOCK_K
            mask_k = offs_k < H - k
            xv = tile_row(x_row + k, offs_n, offs_k, mask_k)
            wg = tl.load(g_ptrs + k, mask=mask_k[None, :], other=0.0).to(tl.float32)
            wu = tl.load(g_ptrs + up_off + k, mask=mask_k[None, :], other=0.0).to(tl.float32)
            if GROUP_K:  # the chunk lies in group j (BLOCK_K divides GROUP_K): x's and W's scales
                j = tl.minimum(k, H - 1) // GROUP_K  # (a chunk past the end: its products are 0)
                sa = tl.load(sx_ptr + (p // TOPK) * stride_sx + j)
                acc_g += wg * xv * (sa * tl.load(sg_ptrs + j))[:, None]
                acc_u += wu * xv * (sa * tl.load(su_ptrs + j))[:, None]
            else:
                acc_g += wg * xv
                acc_u += wu * xv
    g = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if SCALED and GROUP_K == 0:  # float8 x (per token) and W (per row): both scales multiplied back in, fp32
        sx = tl.load(sx_ptr + p // TOPK)
        g = g * sx * tl.load(sw_ptr + expert * stride_se + rows)
        up = up * sx * tl.load(sw_ptr + expert * stride_se + INTER + rows)
    g = _round_to(g, DTYPE, INTERP).to(tl.float32)
    up = _round_to(up, DTYPE, INTERP).to(tl.float32)
    if HAS_BIAS:  # added to the rounded products and rounded again, as the reference's x @ W + b
        bias = bias_ptr + expert * (2 * INTER) + rows
        g = _round_to(g + tl.load(bias).to(tl.float32), DTYPE, INTERP).to(tl.float32)
        up = _round_to(up + tl.load(bias + INTER).to(tl.float32), DTYPE, INTERP).to(tl.float32)
    h = moe_glu(g, up, ACT, ALPHA, LIMIT, DTYPE, INTERP)
    tl.store(out_ptr + p * stride_o + offs_n, h, mask=offs_n < INTER)


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    weight_ptr,
    out_ptr,
    sh_ptr,
    sw_ptr,
    bias_ptr,
    H,
    INTER,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    stride_se,
    stride_sn,
    stride_sh,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
):
    """out[t, n] for BLOCK_N rows n (each slot's product plus its expert's bias [E, H] with
    HAS_BIAS): the tile's rows are (slot j, row n) pairs, r = j * BLOCK_N + i, so the k
    slots' W rows (k experts) stream at once rather than one slot after the other
    (at batch 1 a slot's 4 rows x I columns were too few bytes in flight: 1.5 TB/s)."""
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    r = tl.arange(0, TOPK_PAD * BLOCK_N)
    slot = r // BLOCK_N
    n = tl.minimum(n0 + r % BLOCK_N, H - 1)  # tail rows re-read row H-1; the store masks them
    p = t * TOPK + tl.minimum(slot, TOPK - 1)  # padding slots re-read the last one, weighted 0
    # Before the PDL wait: the ids are the router's, which completed before the kernel before this one
    # (the gate_up GEMV, or the quantization after it) passed its own wait, so they are final; read
    # from L2 (.cg), and the experts' rows asked of L2 while that kernel ends.
    expert = tl.load(ids_ptr + p, cache_modifier=".cg").to(tl.int64)
    w_rows = w_ptr + expert * stride_we + n.to(tl.int64) * stride_wn
    _prefetch_l2(w_rows, INTER, PREFETCH)
    _pdl_enter(PDL)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_rows[:, None] + offs_k[None, :]
    h_ptrs = h_ptr + p[:, None] * stride_h + offs_k[None, :]  # (a slot's rows share h: L1 hits)
    s_ptrs = sw_ptr + expert * stride_se + (n // GROUP_N) * stride_sn  # (block scales)
    acc = tl.zeros([TOPK_PAD * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + u * BLOCK_K
            mask_k = (offs_k < INTER - k)[None, :]
            hv = tl.load(h_ptrs + k, mask=mask_k, other=0.0).to(tl.float32)
            wv = tl.load(w_ptrs + k, mask=mask_k, other=0.0).to(tl.float32)
            if GROUP_K:  # the chunk lies in group j: each row's inter and W block scales
                j = tl.minimum(k, INTER - 1) // GROUP_K  # (past the end: products 0)
                s = tl.load(sh_ptr + p * stride_sh + j) * tl.load(s_ptrs + j)
                acc += wv * hv * s[:, None]
            else:
                acc += wv * hv
    d = tl.sum(acc, axis=1)
    if SCALED and GROUP_K == 0:
        d = d * tl.load(sh_ptr + p) * tl.load(sw_ptr + expert * stride_se + n)
    d = _round_to(d, DTYPE, INTERP).to(tl.float32)  # each slot's product in x's dtype
    if HAS_BIAS:  # (n and p clamped above: in bounds)
        d = _round_to(d + tl.load(bias_ptr + expert * H + n).to(tl.float32), DTYPE, INTERP).to(tl.float32)
    d = tl.where(slot < TOPK, d * tl.load(weight_ptr + p), 0.0)
    # y[i] = sum over the slots of d[j * BLOCK_N + i] (float32)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    pick = (r % BLOCK_N)[None, :] == tl.arange(0, BLOCK_N)[:, None]
    y = tl.sum(tl.where(pick, d[None, :], 0.0), axis=1)
    tl.store(out_ptr + t * stride_o + offs_n, _round_to(y, DTYPE, INTERP), mask=offs_n < H)


def moe_gemv(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    unroll: int = UNROLL,
    down: tuple[int, int, int, int] | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = reference.SWIGLU_ALPHA,
    swiglu_limit: float = reference.SWIGLU_LIMIT,
    block: tuple[int, int] | None = None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """kernels.reference_moe.fused_moe for a few tokens: x [T, H]; w_gate_up [E, 2I, H]; w_down
    [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int -> [T, H] in x's dtype.
    Two kernels, no host synchronisation (CUDA-graph capturable). With the scales (float8
    experts): x and the activation quantized per row first (two more kernels); with block =
    (bn, bk), block-scaled experts (kernels/moe_operands.py): per row and group of bk columns,
    the K chunks cut to divide bk (`group_tile`) and unrolled further to keep the bytes in flight.
    block_n, block_k, unroll: GEMM 1's tiles; down: GEMM 2's (block_n, block_k, unroll,
    num_warps), default DOWN. activation, swiglu_alpha, swiglu_limit and the expert biases
    (w_gate_up_bias [E, 2I], w_down_bias [E, H]): the reference's, the biases added in the
    GEMMs' epilogues. x_rows: x's float8 rows and scales made by the caller (per-row experts)."""
    act = act_constants(activation, swiglu_alpha, swiglu_limit)
    t, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    assert w_gate_up.shape == (experts, 2 * inter, hidden) and w_down.shape == (experts, hidden, inter)
    assert topk_weights.shape == topk_ids.shape == (t, topk)
    out = torch.empty_like(x)
    if t == 0:
        return out
    b_gu = bias_operand(w_gate_up_bias, (experts, 2 * inter), x)
    b_d = bias_operand(w_down_bias, (experts, hidden), x)
    scaled, x, sx, sw_gu, sw_d = fp8_operands(x, w_gate_up_scale, w_down_scale, block,
                                              (tuple(w_gate_up.shape), tuple(w_down.shape)), x_rows)
    d_n, d_k, d_unroll, d_warps = down or DOWN
    group_n, group_k = block or (1, 0)
    grid_rows = (sw_gu.stride(1), sw_d.stride(1)) if block is not None else (0, 0)  # (W's block grid rows)
    if block is not None:
        tile, d_tile = group_tile(block_k, group_k, 16), group_tile(d_k, group_k, 16)
        block_k, unroll = tile, unroll * max(1, block_k // tile)
        d_k, d_unroll = d_tile, d_unroll * max(1, d_k // d_tile)
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    dtype = _TL_DTYPES[out.dtype]
    interp = _interpreting()
    pdl = _pdl_enabled(x)
    h = torch.empty((t * topk, inter), dtype=out.dtype, device=x.device)
    _gate_up_kernel[(t * topk, triton.cdiv(inter, block_n))](
        x, w_gate_up, ids, h, sx, sw_gu, b_gu,
        hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), inter * w_gate_up.stride(1), h.stride(0),
        sw_gu.stride(0), grid_rows[0], sx.stride(0),
        TOPK=topk, BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, GROUP_N=group_n, GROUP_K=group_k,
        **act, HAS_BIAS=w_gate_up_bias is not None, SCALED=scaled, DTYPE=dtype, INTERP=interp, PDL=pdl,
        num_warps=4, num_stages=1, launch_pdl=pdl,
    )  # fmt: skip
    sh = h
    if scaled:
        h, sh = quantize_rows(h) if block is None else quantize_groups(h, group_k)
    _down_kernel[(t, triton.cdiv(hidden, d_n))](
        h, w_down, ids, weights, out, sh, sw_d, b_d,
        hidden, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), sw_d.stride(0), grid_rows[1], sh.stride(0),
        TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), BLOCK_N=d_n, BLOCK_K=d_k, UNROLL=d_unroll,
        GROUP_N=group_n, GROUP_K=group_k,
        HAS_BIAS=w_down_bias is not None, SCALED=scaled, DTYPE=dtype, INTERP=interp, PDL=pdl,
        PREFETCH=_prefetch_lines(inter * w_down.element_size(), pdl), num_warps=d_warps, num_stages=1, launch_pdl=pdl,
    )  # fmt: skip
    return out
