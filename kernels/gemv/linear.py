"""`gemv`: y[M, N] = x[M, K] @ W[N, K]^T for M <= 4, with a split-K reduction when the
programs are too few (see the package's docstring)."""

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
from kernels.gemv.config import MAX_M, GemvConfig, gemv_config, rows_per_program
from kernels.gemv.config import num_sms as _num_sms


@triton.jit
def _x_chunk(row_ptr, offs_n, offs_k, k_left, EVEN_K: tl.constexpr):
    """x[m, k : k + BLOCK_K] as fp32, broadcastable against the [BLOCK_N, BLOCK_K] W tile.

    x is loaded straight into W's register layout, as a [BLOCK_N, BLOCK_K] tile whose
    rows share addresses (L1 hits): a 1-D load would be re-laid out through shared
    memory, with a barrier, every chunk.
    """
    ptrs = row_ptr + offs_k[None, :] + (offs_n * 0)[:, None]
    if EVEN_K:
        v = tl.load(ptrs, eviction_policy="evict_last").to(tl.float32)
    else:
        v = tl.load(ptrs, mask=(offs_k < k_left)[None, :], other=0.0, eviction_policy="evict_last")
        v = v.to(tl.float32)
    return v


@triton.jit
def _fma(acc, w, xv, ACC_1D: tl.constexpr):
    if ACC_1D:
        acc = acc + tl.sum(w * xv, axis=1)
    else:
        acc = acc + w * xv
    return acc


@triton.jit
def _finish_row(
    acc,
    m,
    M,
    N,
    offs_n,
    out_ptr,
    stride_om,
    ws_ptr,
    pid_k,
    sx_ptr,
    sw_ptr,
    rows,
    ACC_1D: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    if ACC_1D:
        y = acc
    else:
        y = tl.sum(acc, axis=1)
    if SCALED:  # float8 operands: both scales multiplied back in, in fp32 (as torch._scaled_mm)
        y = y * tl.load(sx_ptr + tl.minimum(m, M - 1)) * tl.load(sw_ptr + rows)
    mask = offs_n < tl.where(m < M, N, 0)  # (scalar & vector masks upset the interpreter)
    if SPLIT:
        tl.store(ws_ptr + (pid_k * M + m).to(tl.int64) * N + offs_n, y, mask=mask)
    else:
        tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, _round_to(y, OUT_DTYPE, INTERP), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    ws_ptr,
    sx_ptr,
    sw_ptr,
    M,
    N,
    K,
    k_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    ACC_1D: tl.constexpr,
    SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * k_split
    k_len = tl.minimum(K - k0, k_split)
    rows = tl.minimum(offs_n, N - 1)  # tail rows re-read row N-1; the store masks them
    w_rows = w_ptr + rows.to(tl.int64) * stride_wn + k0
    _prefetch_l2(w_rows, k_len, PREFETCH)  # (weights: no kernel before writes them)
    _pdl_enter(PDL)
    w_ptrs = w_rows[:, None] + offs_k[None, :]
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + k0
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + k0
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + k0
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + k0
    if ACC_1D:
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k in range(0, k_split, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            kk = k + u * BLOCK_K
            if EVEN_K:
                w = tl.load(w_ptrs + kk, eviction_policy="evict_first")
            else:
                kmask = (offs_k < k_len - kk)[None, :]
                w = tl.load(w_ptrs + kk, mask=kmask, other=0.0, eviction_policy="evict_first")
            w = w.to(tl.float32)
            xa = _x_chunk(x0 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
            acc0 = _fma(acc0, w, xa, ACC_1D)
            if BLOCK_M > 1:
                xa = _x_chunk(x1 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
                acc1 = _fma(acc1, w, xa, ACC_1D)
            if BLOCK_M > 2:
                xa = _x_chunk(x2 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
                acc2 = _fma(acc2, w, xa, ACC_1D)
            if BLOCK_M > 3:
                xa = _x_chunk(x3 + kk, offs_n, offs_k, k_len - kk, EVEN_K)
                acc3 = _fma(acc3, w, xa, ACC_1D)
    _finish_row(
        acc0, m0, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
        SCALED, OUT_DTYPE, INTERP,
    )
    if BLOCK_M > 1:
        _finish_row(
            acc1, m0 + 1, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
            SCALED, OUT_DTYPE, INTERP,
        )
    if BLOCK_M > 2:
        _finish_row(
            acc2, m0 + 2, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
            SCALED, OUT_DTYPE, INTERP,
        )
    if BLOCK_M > 3:
        _finish_row(
            acc3, m0 + 3, M, N, offs_n, out_ptr, stride_om, ws_ptr, pid_k, sx_ptr, sw_ptr, rows, ACC_1D, SPLIT,
            SCALED, OUT_DTYPE, INTERP,
        )


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,
    out_ptr,
    total,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    """out.flat[i] = sum over s (in order) of ws[s].flat[i]; ws [SPLITS, M*N] fp32."""
    _pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _round_to(acc, OUT_DTYPE, INTERP), mask=mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    per_row: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight) for a few rows: x [..., K], weight [N, K] -> [..., N] in out_dtype
    (default x.dtype).

    per_row: every row as if it were alone, bit for bit: the config of M = 1 for any M (the rows
    of a speculative verify step that must equal decode's). A program's rows (up to 4, fewer
    where M = 1's float8 chunks would spill: `rows_per_program`) share its W tiles, each with
    its own accumulator and the same sequence of operations.

    x and weight may differ in dtype (fp32 / fp16 / bf16): both are read as fp32. With
    `scales` = (sx [M] or [M, 1], sw [N]), both operands are float8 (x quantized row by
    row, W row by row: streamer/model/quant.py) and y[m, n] = sx[m] * sw[n] * sum_k
    x[m, k] * W[n, k], what torch._scaled_mm computes; out_dtype must then be given.

    Meant for M = prod(x.shape[:-1]) <= 4 (see `use_gemv`); larger M works but
    re-reads W once per 4 rows. One or two launches, no host synchronisation.
    """
    k = x.shape[-1]
    assert weight.dim() == 2 and weight.shape[1] == k, (tuple(x.shape), tuple(weight.shape))
    assert x.dtype in _TL_DTYPES and weight.dtype in _TL_DTYPES, (x.dtype, weight.dtype)
    fp8 = scales is not None
    assert fp8 == (x.dtype == torch.float8_e4m3fn) and (out_dtype is not None or not fp8), "float8 x: scales, out_dtype"
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        return out.zero_().view(*x.shape[:-1], n)
    sx, sw = _scale_args(scales, m, n, out)
    cfg = config or gemv_config(1 if per_row else m, n, k, _num_sms(x.device), weight.element_size())
    block_m = min(m, rows_per_program(cfg) if per_row else MAX_M)
    step = cfg.block_k * cfg.unroll
    k_split = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), step) * step
    splits = triton.cdiv(k, k_split)
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    dtype = _TL_DTYPES[out_dtype]
    interp = _interpreting()
    pdl = _pdl_enabled(x)
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, block_m))
    _gemv_kernel[grid](
        x2,
        weight,
        out,
        ws,
        sx,
        sw,
        m,
        n,
        k,
        k_split,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UNROLL=cfg.unroll,
        EVEN_K=k % k_split == 0,
        SPLIT=splits > 1,
        ACC_1D=cfg.acc_1d,
        SCALED=fp8,
        OUT_DTYPE=dtype,
        INTERP=interp,
        PDL=pdl,
        PREFETCH=_prefetch_lines(k_split * weight.element_size(), pdl),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    if splits > 1:
        total = m * n
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(total, block),)](
            ws, out, total, SPLITS=splits, BLOCK=block, OUT_DTYPE=dtype, INTERP=interp, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )
    return out.view(*x.shape[:-1], n)


def _scale_args(scales, m: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scale vectors of a float8 call (or placeholders the kernel does not read)."""
    if scales is None:
        return like, like
    sx, sw = (s.reshape(-1) for s in scales)
    assert sx.numel() == m and sw.numel() == n, (tuple(sx.shape), tuple(sw.shape), m, n)
    assert sx.dtype == sw.dtype == torch.float32
    return sx.contiguous(), sw.contiguous()
