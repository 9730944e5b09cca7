"""`gemv_glu`: silu_and_mul(F.linear(x, W)) for a row or a few, the activation in the epilogue."""

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
from kernels.gemv.config import MAX_M, GemvConfig, glu_config
from kernels.gemv.linear import _scale_args, _x_chunk


@triton.jit
def _glu_fma(g, u, wg, wu, x_ptr, offs_n, offs_k, k_left, EVEN_K: tl.constexpr):
    """One chunk of one row: its gate and up accumulators plus the chunk's products."""
    xv = _x_chunk(x_ptr, offs_n, offs_k, k_left, EVEN_K)
    return g + wg * xv, u + wu * xv


@triton.jit
def _glu_store(acc_g, acc_u, m, M, N, offs_n, rows, out_ptr, sx_ptr, sw_ptr,
               SCALED: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Row m's epilogue: the two dot products, their scales, silu(gate) * up; stored if m < M."""
    g = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if SCALED:  # float8 operands: the scales of x, of the gate rows and of the up rows
        sx = tl.load(sx_ptr + tl.minimum(m, M - 1))
        g = g * sx * tl.load(sw_ptr + rows)
        up = up * sx * tl.load(sw_ptr + N + rows)
    g = _round_to(g, OUT_DTYPE, INTERP).to(tl.float32)
    up = _round_to(up, OUT_DTYPE, INTERP).to(tl.float32)
    s = _round_to(g / (1.0 + tl.exp(-g)), OUT_DTYPE, INTERP).to(tl.float32)
    mask = offs_n < tl.where(m < M, N, 0)  # (scalar & vector masks upset the interpreter)
    tl.store(out_ptr + m.to(tl.int64) * N + offs_n, _round_to(s * up, OUT_DTYPE, INTERP), mask=mask)


@triton.jit
def _gemv_glu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sx_ptr,
    sw_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
):
    """out[m, n] = silu(x[m] . W[n]) * (x[m] . W[N + n]): W holds [gate; up] ([2N, K]); BLOCK_M
    (<= 4) rows of x per program (program_id(1)), each accumulated exactly as a lone row is, on
    the same W tiles (speculation's verify rows equal decode's bit for bit).

    Each program streams BLOCK_N gate rows and the BLOCK_N up rows that pair with them,
    so the activation is applied in the epilogue, on values already in registers.
    Rounding follows the unfused path (gate_up output, silu, product: each to the
    activation dtype), so the result is what silu_and_mul(gemv(x, W)) gives."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(1) * BLOCK_M
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1)  # tail rows re-read row N-1; the store masks them
    g_rows = w_ptr + rows.to(tl.int64) * stride_wn
    _prefetch_l2(g_rows, K, PREFETCH)  # (weights: no kernel before writes them)
    _prefetch_l2(g_rows + N.to(tl.int64) * stride_wn, K, PREFETCH)
    g_ptrs = g_rows[:, None] + offs_k[None, :]
    u_ptrs = g_ptrs + N.to(tl.int64) * stride_wn
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm
    _pdl_enter(PDL)
    g0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    u0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    g1, u1, g2, u2, g3, u3 = g0, u0, g0, u0, g0, u0
    for k in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            kk = k + u * BLOCK_K
            if EVEN_K:
                wg = tl.load(g_ptrs + kk, eviction_policy="evict_first")
                wu = tl.load(u_ptrs + kk, eviction_policy="evict_first")
            else:
                kmask = (offs_k < K - kk)[None, :]
                wg = tl.load(g_ptrs + kk, mask=kmask, other=0.0, eviction_policy="evict_first")
                wu = tl.load(u_ptrs + kk, mask=kmask, other=0.0, eviction_policy="evict_first")
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
            g0, u0 = _glu_fma(g0, u0, wg, wu, x0 + kk, offs_n, offs_k, K - kk, EVEN_K)
            if BLOCK_M > 1:
                g1, u1 = _glu_fma(g1, u1, wg, wu, x1 + kk, offs_n, offs_k, K - kk, EVEN_K)
            if BLOCK_M > 2:
                g2, u2 = _glu_fma(g2, u2, wg, wu, x2 + kk, offs_n, offs_k, K - kk, EVEN_K)
            if BLOCK_M > 3:
                g3, u3 = _glu_fma(g3, u3, wg, wu, x3 + kk, offs_n, offs_k, K - kk, EVEN_K)
    _glu_store(g0, u0, m0, M, N, offs_n, rows, out_ptr, sx_ptr, sw_ptr, SCALED, OUT_DTYPE, INTERP)
    if BLOCK_M > 1:
        _glu_store(g1, u1, m0 + 1, M, N, offs_n, rows, out_ptr, sx_ptr, sw_ptr, SCALED, OUT_DTYPE, INTERP)
    if BLOCK_M > 2:
        _glu_store(g2, u2, m0 + 2, M, N, offs_n, rows, out_ptr, sx_ptr, sw_ptr, SCALED, OUT_DTYPE, INTERP)
    if BLOCK_M > 3:
        _glu_store(g3, u3, m0 + 3, M, N, offs_n, rows, out_ptr, sx_ptr, sw_ptr, SCALED, OUT_DTYPE, INTERP)


def gemv_glu(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)) for a few rows: x [..., K], weight [2I, K] holding the
    gate rows then the up rows (a fused gate_up_proj) -> [..., I] in out_dtype (default
    x.dtype). `scales` as in `gemv` (float8 x and W: sx [M]). Each row is computed as if it were
    alone (up to 4 rows per program share its W tiles, each with its own accumulators: meant for
    the one row of a decode step and the few rows of a verify step that must equal it).

    At decode this saves the activation kernel's launch and its round trip through memory."""
    k = x.shape[-1]
    assert weight.dim() == 2 and weight.shape[1] == k and weight.shape[0] % 2 == 0, (
        tuple(x.shape),
        tuple(weight.shape),
    )
    assert x.dtype in _TL_DTYPES and weight.dtype in _TL_DTYPES, (x.dtype, weight.dtype)
    fp8 = scales is not None
    assert fp8 == (x.dtype == torch.float8_e4m3fn) and (out_dtype is not None or not fp8), "float8 x: scales, out_dtype"
    n = weight.shape[0] // 2
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out_dtype = out_dtype or x.dtype
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if n == 0 or k == 0 or m == 0:
        return (out.zero_() if n else out).view(*x.shape[:-1], n)
    sx, sw = _scale_args(scales, m, 2 * n, out)
    cfg = config or glu_config(n, k, weight.element_size())
    dtype = _TL_DTYPES[out_dtype]
    pdl = _pdl_enabled(x)
    block_m = min(m, MAX_M)
    _gemv_glu_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))](
        x2,
        weight,
        out,
        sx,
        sw,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UNROLL=cfg.unroll,
        EVEN_K=k % (cfg.block_k * cfg.unroll) == 0,
        SCALED=fp8,
        OUT_DTYPE=dtype,
        INTERP=_interpreting(),
        PDL=pdl,
        PREFETCH=_prefetch_lines(k * weight.element_size(), pdl),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return out.view(*x.shape[:-1], n)
