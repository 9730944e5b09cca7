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
from kernels.common import prefetch_l2 as _prefetch_l2
from kernels.common import prefetch_lines as _prefetch_lines
from kernels.common import round_to as _round_to
from kernels.moe_gemv import BLOCK_K, BLOCK_N, DOWN, MAX_TOKENS, UNROLL, tile_row
from kernels.moe_operands import act_constants, bias_operand
from kernels.moe_route import ROUTER_K

_MODE = os.environ.get("STREAMER_MOE_CHAIN", "0")
ENABLED = _MODE in ("1", "preload", "route")
PRELOAD = _MODE == "preload"
ROUTE = _MODE == "route"
"""An experiment (kernels.ops.fused_moe takes this path for 16-bit experts at a few tokens):
STREAMER_MOE_CHAIN=1, or =preload for the down tiles' first chunk loaded before their spin, or
=route for the router in the same launch too (kernels.ops.norm_route_moe)."""

WARPS = 4
"""One num_warps for both kinds of tile (gate_up's is 4 in moe_gemv, down's 8)."""


@triton.jit
def _topk(z, offs, valid, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
          DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """moe_route._topk_store's routing of one token's logits z [BLOCK_E], returned (weights, ids:
    slot j's at position j < TOPK) rather than stored."""
    z = z - tl.max(z, axis=0)
    num = tl.where(valid, tl.exp(z), 0.0)
    probs = num / tl.sum(num, axis=0)
    probs = tl.where(probs == probs, probs, 0.0)  # (non-finite rows: the lowest experts, as there)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - offs), -1)
    picked = tl.zeros([BLOCK_E], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_E], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(TOPK):
        key = tl.max(keys, axis=0)
        idx = (BLOCK_E - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
        best = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        total += best
        picked = tl.where(offs == j, best, picked)
        picked_ids = tl.where(offs == j, idx, picked_ids)
        keys = tl.where(offs == idx, -1, keys)
    w = picked / total if RENORM else picked
    if ROUND:
        w = _round_to(w, DTYPE, INTERP).to(tl.float32)
    return w, picked_ids


@triton.jit
def _wait_routed(sync_ptr, t, MAX_T: tl.constexpr):
    """Until token t is routed (its ids and weights stored: sync[2 + 2 * MAX_T + t])."""
    while tl.load(sync_ptr + 2 + 2 * MAX_T + t, volatile=True) == 0:
        pass
    tl.atomic_add(sync_ptr + 2 + 2 * MAX_T + t, 0, sem="acquire")


@triton.jit
def _router_tile(x_ptr, res_ptr, nw_ptr, wr_ptr, logits_ptr, normed_ptr, new_res_ptr, eps, ticket, E, H, stride_x,
                 stride_r, stride_wr, stride_n, BLOCK_E: tl.constexpr, RK: tl.constexpr, X_DTYPE: tl.constexpr,
                 LOGIT_DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """moe_route._router_kernel's program (t, e) with NORM and one row (ROUTER_ROWS): token t's
    logit for expert e from rms_norm(x + residual), stored; expert 0's tile also stores the
    normalized row and the sum. Returns t."""
    t = (ticket // E).to(tl.int64)
    rows = ticket % E + tl.arange(0, 1)
    offs_k = tl.arange(0, RK)
    w_ptrs = wr_ptr + rows[:, None].to(tl.int64) * stride_wr + offs_k[None, :]
    sq = tl.zeros([1, RK], dtype=tl.float32)
    for k in range(0, H, RK):
        mask_k = offs_k < H - k
        xs = tile_row(x_ptr + t * stride_x + k, rows, offs_k, mask_k)
        xs = _round_to(xs + tile_row(res_ptr + t * stride_r + k, rows, offs_k, mask_k), X_DTYPE, INTERP)
        xs = xs.to(tl.float32)
        sq += xs * xs
    rstd = 1.0 / tl.sqrt(tl.max(tl.sum(sq, axis=1), axis=0) / H + eps)
    acc = tl.zeros([1, RK], dtype=tl.float32)
    for k in range(0, H, RK):
        mask_k = offs_k < H - k
        xv = tile_row(x_ptr + t * stride_x + k, rows, offs_k, mask_k)
        xs = _round_to(xv + tile_row(res_ptr + t * stride_r + k, rows, offs_k, mask_k), X_DTYPE, INTERP)
        nv = tile_row(nw_ptr + k, rows, offs_k, mask_k)
        xn = _round_to(nv * _round_to(xs.to(tl.float32) * rstd, X_DTYPE, INTERP).to(tl.float32), LOGIT_DTYPE, INTERP)
        keep = (rows == 0)[:, None] & mask_k[None, :]
        at = k + offs_k[None, :] + (rows * 0)[:, None]
        tl.store(new_res_ptr + t * stride_r + at, xs, mask=keep)
        tl.store(normed_ptr + t * stride_n + at, xn, mask=keep)
        acc += tl.load(w_ptrs + k, mask=mask_k[None, :], other=0.0).to(tl.float32) * xn.to(tl.float32)
    z = _round_to(tl.sum(acc, axis=1), LOGIT_DTYPE, INTERP).to(tl.float32)
    tl.store(logits_ptr + t * BLOCK_E + rows, z)
    return t


@triton.jit
def _route_last(sync_ptr, logits_ptr, ids_ptr, weight_ptr, t, E, MAX_T: tl.constexpr, TOPK: tl.constexpr,
                BLOCK_E: tl.constexpr, RENORM: tl.constexpr, R_ROUND: tl.constexpr, R_DTYPE: tl.constexpr,
                INTERP: tl.constexpr):
    """After a router tile of token t stored its logit: the last of t's E tiles routes t (as
    moe_route's router kernel: `_topk`), stores its ids and weights, then raises its flag."""
    tl.debug_barrier()  # every thread's stores before the count says so
    done = tl.atomic_add(sync_ptr + 2 + MAX_T + t, 1, sem="acq_rel")
    if done == E - 1:
        offs = tl.arange(0, BLOCK_E)
        z = tl.load(logits_ptr + t * BLOCK_E + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
        w, ids = _topk(z, offs, offs < E, TOPK, BLOCK_E, RENORM, R_ROUND, R_DTYPE, INTERP)
        tl.store(weight_ptr + t * TOPK + offs, w, mask=offs < TOPK)
        tl.store(ids_ptr + t * TOPK + offs, ids, mask=offs < TOPK)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 2 + 2 * MAX_T + t, 1, sem="release")


@triton.jit
def _gate_up_tile(x_ptr, wgu_ptr, ids_ptr, h_ptr, bgu_ptr, ticket, H, INTER, stride_x, stride_gue, stride_gun, up_off,
                  stride_h, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                  ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  DTYPE: tl.constexpr, INTERP: tl.constexpr, sync_ptr, logits_ptr, E, MAX_T: tl.constexpr,
                  ROUTE: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, R_ROUND: tl.constexpr,
                  R_DTYPE: tl.constexpr):
    """moe_gemv's _gate_up_kernel program (p, n-block) for ticket p * cdiv(I, BLOCK_N) + n-block
    (16-bit experts); returns the token. ROUTE: the slot's expert once its token is routed
    (`_wait_routed`, read through L2), and x (the normalized rows, stored in this launch) read through L2."""
    n_gu = tl.cdiv(INTER, BLOCK_N)
    p = (ticket // n_gu).to(tl.int64)
    if ROUTE:
        _wait_routed(sync_ptr, p // TOPK, MAX_T)
        expert = tl.load(ids_ptr + p, cache_modifier=".cg").to(tl.int64)
    else:
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
            if ROUTE:
                x_ptrs = x_row + k + offs_k[None, :] + (offs_n * 0)[:, None]
                xv = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
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
               INTERP: tl.constexpr, PRELOAD: tl.constexpr, logits_ptr, E, MAX_T: tl.constexpr,
               ROUTE: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, R_ROUND: tl.constexpr,
               R_DTYPE: tl.constexpr):
    """moe_gemv's _down_kernel program (t, n-block) for down ticket d = t * cdiv(H, D_N) + n-block,
    once token t's `need` gate_up tiles have finished (sync[1 + t]); h read through L2 (.cg:
    other SMs wrote it in this launch). ROUTE: the slots' experts and weights once the token
    is routed (`_wait_routed`, read through L2)."""
    n_d = tl.cdiv(H, D_N)
    t = (d // n_d).to(tl.int64)
    n0 = (d % n_d) * D_N
    r = tl.arange(0, TOPK_PAD * D_N)
    slot = r // D_N
    n = tl.minimum(n0 + r % D_N, H - 1)
    p = t * TOPK + tl.minimum(slot, TOPK - 1)
    if ROUTE:
        _wait_routed(sync_ptr, t, MAX_T)
        expert = tl.load(ids_ptr + p, cache_modifier=".cg").to(tl.int64)
        weight = tl.load(weight_ptr + p, cache_modifier=".cg")
    else:
        expert = tl.load(ids_ptr + p).to(tl.int64)
        weight = tl.load(weight_ptr + p)
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
    dv = tl.where(slot < TOPK, dv * weight, 0.0)
    offs_n = n0 + tl.arange(0, D_N)
    pick = (r % D_N)[None, :] == tl.arange(0, D_N)[:, None]
    y = tl.sum(tl.where(pick, dv[None, :], 0.0), axis=1)
    tl.store(out_ptr + t * stride_o + offs_n, _round_to(y, DTYPE, INTERP), mask=offs_n < H)


@triton.jit
def _expert_tile(x_ptr, wgu_ptr, wd_ptr, ids_ptr, weight_ptr, h_ptr, out_ptr, bgu_ptr, bd_ptr, sync_ptr, ticket, T, H,
                 INTER, stride_x, stride_gue, stride_gun, up_off, stride_h, stride_de, stride_dn, stride_o,
                 TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UNROLL: tl.constexpr, D_N: tl.constexpr, D_K: tl.constexpr, D_UNROLL: tl.constexpr,
                 MAX_T: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr, PRELOAD: tl.constexpr, logits_ptr,
                 E, ROUTE: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, R_ROUND: tl.constexpr,
                 R_DTYPE: tl.constexpr):
    """Expert ticket `ticket`: a gate_up tile below T * k * cdiv(I, BLOCK_N) (its token's count
    raised after), else a down tile."""
    gate_up_tiles = T * TOPK * tl.cdiv(INTER, BLOCK_N)
    if ticket < gate_up_tiles:
        t = _gate_up_tile(x_ptr, wgu_ptr, ids_ptr, h_ptr, bgu_ptr, ticket, H, INTER, stride_x, stride_gue, stride_gun,
                          up_off, stride_h, TOPK, BLOCK_N, BLOCK_K, UNROLL, ACT, ALPHA, LIMIT, HAS_BIAS, DTYPE, INTERP,
                          sync_ptr, logits_ptr, E, MAX_T, ROUTE, BLOCK_E, RENORM, R_ROUND, R_DTYPE)
        tl.debug_barrier()  # every thread's h stored before the count says so
        tl.atomic_add(sync_ptr + 1 + t, 1, sem="release")
    else:
        _down_tile(wd_ptr, ids_ptr, weight_ptr, h_ptr, out_ptr, bd_ptr, sync_ptr, ticket - gate_up_tiles, H, INTER,
                   stride_h, stride_de, stride_dn, stride_o, TOPK * tl.cdiv(INTER, BLOCK_N), TOPK, TOPK_PAD, D_N, D_K,
                   D_UNROLL, HAS_BIAS, DTYPE, INTERP, PRELOAD, logits_ptr, E, MAX_T, ROUTE, BLOCK_E, RENORM, R_ROUND,
                   R_DTYPE)


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
    res_ptr=None,
    nw_ptr=None,
    wr_ptr=None,
    logits_ptr=None,
    new_res_ptr=None,
    xin_ptr=None,
    eps=0.0,
    E=1,
    stride_r=0,
    stride_wr=0,
    stride_xin=0,
    ROUTE: tl.constexpr = False,
    BLOCK_E: tl.constexpr = 1,
    RK: tl.constexpr = 1,
    RENORM: tl.constexpr = True,
    R_ROUND: tl.constexpr = False,
    R_DTYPE: tl.constexpr = tl.float32,
    X_DTYPE: tl.constexpr = tl.float32,
    R_PREFETCH: tl.constexpr = 0,
):
    """sync: [0] the tickets drawn, [1 + t] token t's finished gate_up tiles, [1 + MAX_T] the
    programs finished, [2 + MAX_T + t] token t's router tiles finished, [2 + 2 * MAX_T + t] token t
    routed (SYNC_PAD: a power of two >= 3 * MAX_T + 2). ROUTE: tickets below T * E are router tiles (`_router_tile`: xin the
    attention's output, res the residual, nw the norm's weight, wr the router's; x is then where
    the normalized rows go, for the gate_up tiles; ids and weights are written by the last router
    tile of each token, `_route_last`)."""
    if ROUTE:  # (a hint only: the router's rows asked of L2 while the kernel before ends)
        pid = tl.program_id(0)
        if pid < T * E:
            _prefetch_l2(wr_ptr + (pid % E + tl.arange(0, 1)).to(tl.int64) * stride_wr, H, R_PREFETCH)
    _pdl_enter(PDL)
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if ROUTE:
        if ticket < T * E:
            t = _router_tile(xin_ptr, res_ptr, nw_ptr, wr_ptr, logits_ptr, x_ptr, new_res_ptr, eps, ticket, E, H,
                             stride_xin, stride_r, stride_wr, stride_x, BLOCK_E, RK, X_DTYPE, DTYPE, INTERP)
            _route_last(sync_ptr, logits_ptr, ids_ptr, weight_ptr, t, E, MAX_T, TOPK, BLOCK_E, RENORM, R_ROUND,
                        R_DTYPE, INTERP)
        else:
            _expert_tile(x_ptr, wgu_ptr, wd_ptr, ids_ptr, weight_ptr, h_ptr, out_ptr, bgu_ptr, bd_ptr, sync_ptr,
                         ticket - T * E, T, H, INTER, stride_x, stride_gue, stride_gun, up_off, stride_h, stride_de,
                         stride_dn, stride_o, TOPK, TOPK_PAD, BLOCK_N, BLOCK_K, UNROLL, D_N, D_K, D_UNROLL, MAX_T,
                         ACT, ALPHA, LIMIT, HAS_BIAS, DTYPE, INTERP, PRELOAD, logits_ptr, E, ROUTE, BLOCK_E, RENORM,
                         R_ROUND, R_DTYPE)
    else:
        _expert_tile(x_ptr, wgu_ptr, wd_ptr, ids_ptr, weight_ptr, h_ptr, out_ptr, bgu_ptr, bd_ptr, sync_ptr, ticket,
                     T, H, INTER, stride_x, stride_gue, stride_gun, up_off, stride_h, stride_de, stride_dn, stride_o,
                     TOPK, TOPK_PAD, BLOCK_N, BLOCK_K, UNROLL, D_N, D_K, D_UNROLL, MAX_T, ACT, ALPHA, LIMIT, HAS_BIAS,
                     DTYPE, INTERP, PRELOAD, logits_ptr, E, ROUTE, BLOCK_E, RENORM, R_ROUND, R_DTYPE)
    tl.debug_barrier()
    finished = tl.atomic_add(sync_ptr + 1 + MAX_T, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:  # the last program: every count back to 0 for the next call
        z = tl.arange(0, SYNC_PAD)
        tl.store(sync_ptr + z, 0, mask=z < 3 * MAX_T + 2)


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
    t = x.shape[0]
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == t
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    kw = {"w_gate_up_bias": w_gate_up_bias, "w_down_bias": w_down_bias, "swiglu_alpha": swiglu_alpha,
          "swiglu_limit": swiglu_limit}
    return _launch(x.contiguous(), w_gate_up, w_down, ids, weights, topk_ids.shape[1], activation,
                   (block_n, block_k, unroll, down or DOWN[:3], num_warps, preload), kw, {}, 0)


def norm_route_chain(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    top_k: int, renormalize: bool, round_to: torch.dtype | None, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    activation: str = "silu", num_warps: int = WARPS, preload: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_route.norm_route then moe_gemv of the normalized rows with 16-bit experts, in one
    launch: (the experts' output, the normalized rows, x + residual), the same bits. The router
    tiles come first (one per token and expert); the last of a token's router tiles routes it, and
    its gate_up and down tiles wait for that (a flag) before they read its experts."""
    t, hidden = x.shape
    experts = weight.shape[0]
    assert weight.shape == (experts, hidden) and residual.shape == x.shape and norm_weight.shape == (hidden,)
    dtype = torch.promote_types(norm_weight.dtype, x.dtype)  # (the norm's output dtype: the experts' input)
    assert dtype == w_gate_up.dtype, "16-bit experts in the normalized rows' dtype"
    normed = torch.empty((t, hidden), dtype=dtype, device=x.device)
    new_res = torch.empty_like(x)
    block_e = triton.next_power_of_2(experts)
    logits = torch.empty((t, block_e), dtype=torch.float32, device=x.device)
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    route = {
        "res_ptr": residual, "nw_ptr": norm_weight.contiguous(), "wr_ptr": weight, "logits_ptr": logits,
        "new_res_ptr": new_res, "xin_ptr": x, "eps": float(eps), "E": experts, "stride_r": residual.stride(0),
        "stride_wr": weight.stride(0), "stride_xin": x.stride(0), "ROUTE": True, "BLOCK_E": block_e,
        "RK": min(ROUTER_K, triton.next_power_of_2(hidden)), "RENORM": renormalize, "R_ROUND": round_to is not None,
        "R_DTYPE": _TL_DTYPES[round_to or torch.float32], "X_DTYPE": _TL_DTYPES[x.dtype],
        "R_PREFETCH": _prefetch_lines(hidden * weight.element_size(), _pdl_enabled(x)),
    }  # fmt: skip
    ids = torch.empty(t * top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(t * top_k, dtype=torch.float32, device=x.device)
    out = _launch(normed, w_gate_up, w_down, ids, weights, top_k, activation,
                  (BLOCK_N, BLOCK_K, UNROLL, DOWN[:3], num_warps, preload), {}, route, t * experts)
    return out, normed, new_res


def _launch(x, w_gate_up, w_down, ids, weights, topk, activation, tiles, kw, route, router_tiles):
    block_n, block_k, unroll, (d_n, d_k, d_unroll), num_warps, preload = tiles
    t, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    assert 0 < t <= MAX_TOKENS and w_down.shape == (experts, hidden, inter) and w_gate_up.dtype == x.dtype
    act = act_constants(activation, kw.get("swiglu_alpha", reference.SWIGLU_ALPHA),
                        kw.get("swiglu_limit", reference.SWIGLU_LIMIT))
    sync = _syncs.get(x.device)
    if sync is None:
        sync = _syncs[x.device] = torch.zeros(3 * MAX_TOKENS + 2, dtype=torch.int32, device=x.device)
    out = torch.empty_like(x)
    h = torch.empty((t * topk, inter), dtype=x.dtype, device=x.device)
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    b_gu, b_d = kw.get("w_gate_up_bias"), kw.get("w_down_bias")
    pdl = _pdl_enabled(x)
    grid = router_tiles + t * topk * triton.cdiv(inter, block_n) + t * triton.cdiv(hidden, d_n)
    _chain_kernel[(grid,)](
        x, w_gate_up, w_down, ids, weights, h, out,
        bias_operand(b_gu, (experts, 2 * inter), x), bias_operand(b_d, (experts, hidden), x), sync,
        t, hidden, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), inter * w_gate_up.stride(1),
        h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
        TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll,
        D_N=d_n, D_K=d_k, D_UNROLL=d_unroll, MAX_T=MAX_TOKENS, **act, HAS_BIAS=b_gu is not None,
        DTYPE=_TL_DTYPES[x.dtype], INTERP=_interpreting(), PDL=pdl, SYNC_PAD=triton.next_power_of_2(3 * MAX_TOKENS + 2),
        PRELOAD=preload, **route, num_warps=num_warps, num_stages=1, launch_pdl=pdl,
    )  # fmt: skip
    return out
