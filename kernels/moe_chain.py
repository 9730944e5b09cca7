"""The batch-1 MoE MLP's two GEMVs (kernels/moe_gemv.py) in one launch: `moe_chain`.

Why: a decode layer at batch 1 is a chain of short dependent kernels, and each boundary costs
~1-1.5 us (the last wave's tail, the grid's completion and memory flush, the next grid's
ramp). moe_gemv's down GEMV starts only once every gate_up program has ended. Here each
program draws a ticket (an atomic count) and takes the work of that ticket: tickets below
G are gate_up tiles, in moe_gemv's order, the rest down tiles. A down tile of token t spins
until the count of t's finished gate_up tiles reaches k * cdiv(I, BLOCK_N); its expert rows'
first chunks may be loaded before that (PRELOAD), while the last gate_up tiles run.

No deadlock whatever order the hardware starts programs in: a ticket is drawn only by a
running program, and every gate_up ticket is drawn before any down ticket, so the tiles a
down tile waits for are held by programs that are running. The counts live in one zeroed
buffer per device; the last program to finish zeroes them again, so calls on one device must
not overlap (the engine runs its model on one stream).

16-bit experts only (float8 experts keep moe_gemv's kernels and their quantizations).
Same bits as moe_gemv: the tiles' arithmetic is the same code.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.activation import moe_glu
from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to
from kernels.moe_gemv import BLOCK_K, BLOCK_N, DOWN, MAX_TOKENS, UNROLL, tile_row
from kernels.moe_operands import act_constants, bias_operand

ENABLED = os.environ.get("STREAMER_MOE_CHAIN", "0") in ("1", "preload")
PRELOAD = os.environ.get("STREAMER_MOE_CHAIN") == "preload"
"""An experiment (kernels.ops.fused_moe takes this path for 16-bit experts at a few tokens):
STREAMER_MOE_CHAIN=1, or =preload for the down tiles' first chunk loaded before their spin."""

WARPS = 4
"""One num_warps for both kinds of tile (gate_up's is 4 in moe_gemv, down's 8)."""


@triton.jit
def _gate_up_tile(x_ptr, wgu_ptr, ids_ptr, h_ptr, bgu_ptr, ticket, H, INTER, stride_x, stride_gue, stride_gun, up_off,
                  stride_h, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                  ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """moe_gemv's _gate_up_kernel program (p, n-block) for ticket p * cdiv(I, BLOCK_N) + n-block
    (16-bit experts); returns the token."""
    n_gu = tl.cdiv(INTER, BLOCK_N)
    p = (ticket // n_gu).to(tl.int64)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = (ticket % n_gu) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, INTER - 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (p // TOPK) * stride_x
    g_ptrs = wgu_ptr + expert * stride_gue + rows[:, None].to(tl.int64) * stride_gun + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + u * BLOCK_K
            mask_k = offs_k < H - k
            xv = tile_row(x_row + k, offs_n, offs_k, mask_k)
            acc_g += tl.load(g_ptrs + k, mask=mask_k[None, :], other=0.0).to(tl.float32) * xv
            acc_u += tl.load(g_ptrs + up_off + k, mask=mask_k[None, :], other=0.0).to(tl.float32) * xv
    g = _round_to(tl.sum(acc_g, axis=1), DTYPE, INTERP).to(tl.float32)
    up = _round_to(tl.sum(acc_u, axis=1), DTYPE, INTERP).to(tl.float32)
    if HAS_BIAS:
        bias = bgu_ptr + expert * (2 * INTER) + rows
        g = _round_to(g + tl.load(bias).to(tl.float32), DTYPE, INTERP).to(tl.float32)
        up = _round_to(up + tl.load(bias + INTER).to(tl.float32), DTYPE, INTERP).to(tl.float32)
    hv = moe_glu(g, up, ACT, ALPHA, LIMIT, DTYPE, INTERP)
    tl.store(h_ptr + p * stride_h + offs_n, hv, mask=offs_n < INTER)
    return p // TOPK


@triton.jit
def _down_tile(wd_ptr, ids_ptr, weight_ptr, h_ptr, out_ptr, bd_ptr, sync_ptr, d, H, INTER, stride_h, stride_de,
               stride_dn, stride_o, need, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, D_N: tl.constexpr,
               D_K: tl.constexpr, D_UNROLL: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr,
               INTERP: tl.constexpr, PRELOAD: tl.constexpr):
    """moe_gemv's _down_kernel program (t, n-block) for down ticket d = t * cdiv(H, D_N) + n-block,
    once token t's `need` gate_up tiles have finished (sync[1 + t]); h read through L2 (.cg:
    other SMs wrote it in this launch)."""
    n_d = tl.cdiv(H, D_N)
    t = (d // n_d).to(tl.int64)
    n0 = (d % n_d) * D_N
    r = tl.arange(0, TOPK_PAD * D_N)
    slot = r // D_N
    n = tl.minimum(n0 + r % D_N, H - 1)
    p = t * TOPK + tl.minimum(slot, TOPK - 1)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    offs_k = tl.arange(0, D_K)
    w_ptrs = wd_ptr + expert[:, None] * stride_de + n[:, None].to(tl.int64) * stride_dn + offs_k[None, :]
    h_ptrs = h_ptr + p[:, None] * stride_h + offs_k[None, :]
    acc = tl.zeros([TOPK_PAD * D_N, D_K], dtype=tl.float32)
    k_start = 0
    if PRELOAD:  # the first chunk's expert rows on their way while the gate_up tiles end
        w_first = tl.load(w_ptrs, mask=(offs_k < INTER)[None, :], other=0.0)
        k_start = D_K
    while tl.load(sync_ptr + 1 + t, volatile=True) < need:
        pass
    tl.atomic_add(sync_ptr + 1 + t, 0, sem="acquire")  # (orders the h loads after the spin)
    if PRELOAD:
        h_first = tl.load(h_ptrs, mask=(offs_k < INTER)[None, :], other=0.0, cache_modifier=".cg")
        acc += w_first.to(tl.float32) * h_first.to(tl.float32)
    for k0 in range(k_start, INTER, D_K * D_UNROLL):
        for u in tl.static_range(D_UNROLL):
            k = k0 + u * D_K
            mask_k = (offs_k < INTER - k)[None, :]
            hv = tl.load(h_ptrs + k, mask=mask_k, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += tl.load(w_ptrs + k, mask=mask_k, other=0.0).to(tl.float32) * hv
    dv = _round_to(tl.sum(acc, axis=1), DTYPE, INTERP).to(tl.float32)
    if HAS_BIAS:
        dv = _round_to(dv + tl.load(bd_ptr + expert * H + n).to(tl.float32), DTYPE, INTERP).to(tl.float32)
    dv = tl.where(slot < TOPK, dv * tl.load(weight_ptr + p), 0.0)
    offs_n = n0 + tl.arange(0, D_N)
    pick = (r % D_N)[None, :] == tl.arange(0, D_N)[:, None]
    y = tl.sum(tl.where(pick, dv[None, :], 0.0), axis=1)
    tl.store(out_ptr + t * stride_o + offs_n, _round_to(y, DTYPE, INTERP), mask=offs_n < H)


@triton.jit
def _chain_kernel(
    x_ptr,
    wgu_ptr,
    wd_ptr,
    ids_ptr,
    weight_ptr,
    h_ptr,
    out_ptr,
    bgu_ptr,
    bd_ptr,
    sync_ptr,
    T,
    H,
    INTER,
    stride_x,
    stride_gue,
    stride_gun,
    up_off,
    stride_h,
    stride_de,
    stride_dn,
    stride_o,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    D_N: tl.constexpr,
    D_K: tl.constexpr,
    D_UNROLL: tl.constexpr,
    MAX_T: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    SYNC_PAD: tl.constexpr,
    PRELOAD: tl.constexpr = False,
):
    """sync: [0] the tickets drawn, [1 + t] token t's finished gate_up tiles, [1 + MAX_T] the
    programs finished (SYNC_PAD: a power of two >= MAX_T + 2)."""
    _pdl_enter(PDL)
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    gate_up_tiles = T * TOPK * tl.cdiv(INTER, BLOCK_N)
    if ticket < gate_up_tiles:
        t = _gate_up_tile(x_ptr, wgu_ptr, ids_ptr, h_ptr, bgu_ptr, ticket, H, INTER, stride_x, stride_gue, stride_gun,
                          up_off, stride_h, TOPK, BLOCK_N, BLOCK_K, UNROLL, ACT, ALPHA, LIMIT, HAS_BIAS, DTYPE, INTERP)
        tl.debug_barrier()  # every thread's h stored before the count says so
        tl.atomic_add(sync_ptr + 1 + t, 1, sem="release")
    else:
        _down_tile(wd_ptr, ids_ptr, weight_ptr, h_ptr, out_ptr, bd_ptr, sync_ptr, ticket - gate_up_tiles, H, INTER,
                   stride_h, stride_de, stride_dn, stride_o, TOPK * tl.cdiv(INTER, BLOCK_N), TOPK, TOPK_PAD, D_N,
                   D_K, D_UNROLL, HAS_BIAS, DTYPE, INTERP, PRELOAD)
    tl.debug_barrier()
    finished = tl.atomic_add(sync_ptr + 1 + MAX_T, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:  # the last program: every count back to 0 for the next call
        z = tl.arange(0, SYNC_PAD)
        tl.store(sync_ptr + z, 0, mask=z < MAX_T + 2)


_syncs: dict[torch.device, torch.Tensor] = {}


def moe_chain(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    unroll: int = UNROLL,
    down: tuple[int, int, int] | None = None,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = reference.SWIGLU_ALPHA,
    swiglu_limit: float = reference.SWIGLU_LIMIT,
    num_warps: int = WARPS,
    preload: bool = False,
) -> torch.Tensor:
    """moe_gemv.moe_gemv for 16-bit experts in one launch (same arguments, same bits); down:
    the down tiles' (block_n, block_k, unroll)."""
    t, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    assert 0 < t <= MAX_TOKENS and w_down.shape == (experts, hidden, inter)
    assert topk_weights.shape == topk_ids.shape == (t, topk) and w_gate_up.dtype == x.dtype
    act = act_constants(activation, swiglu_alpha, swiglu_limit)
    d_n, d_k, d_unroll = down or DOWN[:3]
    sync = _syncs.get(x.device)
    if sync is None:
        sync = _syncs[x.device] = torch.zeros(MAX_TOKENS + 2, dtype=torch.int32, device=x.device)
    out = torch.empty_like(x)
    h = torch.empty((t * topk, inter), dtype=x.dtype, device=x.device)
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    pdl = _pdl_enabled(x)
    grid = t * topk * triton.cdiv(inter, block_n) + t * triton.cdiv(hidden, d_n)
    _chain_kernel[(grid,)](
        x, w_gate_up, w_down, ids, weights, h, out,
        bias_operand(w_gate_up_bias, (experts, 2 * inter), x), bias_operand(w_down_bias, (experts, hidden), x), sync,
        t, hidden, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), inter * w_gate_up.stride(1),
        h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
        TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll,
        D_N=d_n, D_K=d_k, D_UNROLL=d_unroll, MAX_T=MAX_TOKENS, **act, SYNC_PAD=triton.next_power_of_2(MAX_TOKENS + 2),
        HAS_BIAS=w_gate_up_bias is not None, DTYPE=_TL_DTYPES[x.dtype], INTERP=_interpreting(), PDL=pdl,
        PRELOAD=preload, num_warps=num_warps, num_stages=1, launch_pdl=pdl,
    )  # fmt: skip
    return out
