"""`gemv`: y[M, N] = x[M, K] @ W[N, K]^T for M <= 4, with a split-K reduction when the
programs are too few (see the package's docstring). `norm_gemv`: the same of rms_norm(x +
residual), the norm done by every program on the rows it reads (no norm launch before it).
`gemv(..., keep_splits=True)`: the split-K partials themselves, for a kernel after it that sums
them as it reads its input (kernels/moe_route.py's norm_route)."""

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
def _row_rstd(x_row, r_row, offs_n, offs_k, K, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_RES: tl.constexpr, X_DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """1 / sqrt(mean((x + r)^2) + eps) of the whole row (K values, whatever this program's
    split), x + r rounded to X_DTYPE first as kernels/norm.py's fused add + RMSNorm."""
    sq = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        xs = _x_chunk(x_row + k, offs_n, offs_k, K - k, False)
        if HAS_RES:
            xs = _round_to(xs + _x_chunk(r_row + k, offs_n, offs_k, K - k, False), X_DTYPE, INTERP).to(tl.float32)
        sq += xs * xs
    # (every row of the tile holds the same values: one row's sum)
    return 1.0 / tl.sqrt(tl.max(tl.sum(sq, axis=1), axis=0) / K + eps)


@triton.jit
def _x_in(x_row, r_row, nres_row, nw_row, kk, offs_n, offs_k, k_left, rstd, store_res, rel_n, EVEN_K: tl.constexpr,
          NORM: tl.constexpr, HAS_RES: tl.constexpr, OFFSET: tl.constexpr, X_DTYPE: tl.constexpr,
          NORM_DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """The GEMV's input chunk at kk: x's (`_x_chunk`), or with NORM rms_norm(x + r)'s, rounded
    as kernels/norm.py rounds (so the product is that of the norm's stored output). store_res:
    this program stores x + r of its chunks (one program per row and split: the first row of the
    tile of program column 0, rel_n its rows' index in the tile; `lim` masks the rest)."""
    xs = _x_chunk(x_row + kk, offs_n, offs_k, k_left, EVEN_K)
    if NORM:
        if HAS_RES:
            xs = _round_to(xs + _x_chunk(r_row + kk, offs_n, offs_k, k_left, EVEN_K), X_DTYPE, INTERP)
            lim = tl.where(store_res, 1, 0)  # (scalar & vector masks upset the interpreter)
            keep = (rel_n < lim)[:, None] & (offs_k < k_left)[None, :]
            tl.store(nres_row + kk + offs_k[None, :] + (offs_n * 0)[:, None], xs, mask=keep)
            xs = xs.to(tl.float32)
        nw = _x_chunk(nw_row + kk, offs_n, offs_k, k_left, EVEN_K)
        if OFFSET != 0.0:
            xs = _round_to((xs * rstd) * (OFFSET + nw), X_DTYPE, INTERP).to(tl.float32)
        else:
            xs = _round_to(nw * _round_to(xs * rstd, X_DTYPE, INTERP).to(tl.float32), NORM_DTYPE, INTERP)
            xs = xs.to(tl.float32)
    return xs


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
    res_ptr=None,  # (the launch always passes tensors: placeholders where not NORM)
    nw_ptr=None,
    nres_ptr=None,
    eps=0.0,
    stride_rm=0,
    stride_nm=0,
    NORM: tl.constexpr = False,
    HAS_RES: tl.constexpr = False,
    OFFSET: tl.constexpr = 0.0,
    X_DTYPE: tl.constexpr = tl.float32,
    NORM_DTYPE: tl.constexpr = tl.float32,
):
    """Program (n, k, m): BLOCK_N rows of W over split k of K, against rows m * BLOCK_M.. of x.
    NORM: x's rows are rms_norm(x + res) with the weight at nw_ptr (HAS_RES: with the residual
    add, x + res stored to nres by the programs of column 0), each program normalizing the rows
    it reads: their statistic over the whole row first, from L2."""
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
    ma = tl.minimum(m0, M - 1).to(tl.int64)
    mb = tl.minimum(m0 + 1, M - 1).to(tl.int64)
    mc = tl.minimum(m0 + 2, M - 1).to(tl.int64)
    md = tl.minimum(m0 + 3, M - 1).to(tl.int64)
    x0 = x_ptr + ma * stride_xm + k0
    x1 = x_ptr + mb * stride_xm + k0
    x2 = x_ptr + mc * stride_xm + k0
    x3 = x_ptr + md * stride_xm + k0
    # the norm's operands (NORM; else placeholders nothing reads) and each row's statistic
    r0 = res_ptr + ma * stride_rm + k0
    r1 = res_ptr + mb * stride_rm + k0
    r2 = res_ptr + mc * stride_rm + k0
    r3 = res_ptr + md * stride_rm + k0
    n0 = nres_ptr + ma * stride_nm + k0
    n1 = nres_ptr + mb * stride_nm + k0
    n2 = nres_ptr + mc * stride_nm + k0
    n3 = nres_ptr + md * stride_nm + k0
    nw = nw_ptr + k0
    s0 = 1.0
    s1 = 1.0
    s2 = 1.0
    s3 = 1.0
    if NORM:
        s0 = _row_rstd(x0 - k0, r0 - k0, offs_n, offs_k, K, eps, BLOCK_N, BLOCK_K, HAS_RES, X_DTYPE, INTERP)
        if BLOCK_M > 1:
            s1 = _row_rstd(x1 - k0, r1 - k0, offs_n, offs_k, K, eps, BLOCK_N, BLOCK_K, HAS_RES, X_DTYPE, INTERP)
        if BLOCK_M > 2:
            s2 = _row_rstd(x2 - k0, r2 - k0, offs_n, offs_k, K, eps, BLOCK_N, BLOCK_K, HAS_RES, X_DTYPE, INTERP)
        if BLOCK_M > 3:
            s3 = _row_rstd(x3 - k0, r3 - k0, offs_n, offs_k, K, eps, BLOCK_N, BLOCK_K, HAS_RES, X_DTYPE, INTERP)
    first = pid_n == 0
    rel_n = tl.arange(0, BLOCK_N)
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
            xa = _x_in(x0, r0, n0, nw, kk, offs_n, offs_k, k_len - kk, s0, first, rel_n, EVEN_K, NORM, HAS_RES,
                       OFFSET, X_DTYPE, NORM_DTYPE, INTERP)
            acc0 = _fma(acc0, w, xa, ACC_1D)
            if BLOCK_M > 1:
                xa = _x_in(x1, r1, n1, nw, kk, offs_n, offs_k, k_len - kk, s1, first & (m0 + 1 < M), rel_n,
                           EVEN_K, NORM, HAS_RES, OFFSET, X_DTYPE, NORM_DTYPE, INTERP)
                acc1 = _fma(acc1, w, xa, ACC_1D)
            if BLOCK_M > 2:
                xa = _x_in(x2, r2, n2, nw, kk, offs_n, offs_k, k_len - kk, s2, first & (m0 + 2 < M), rel_n,
                           EVEN_K, NORM, HAS_RES, OFFSET, X_DTYPE, NORM_DTYPE, INTERP)
                acc2 = _fma(acc2, w, xa, ACC_1D)
            if BLOCK_M > 3:
                xa = _x_in(x3, r3, n3, nw, kk, offs_n, offs_k, k_len - kk, s3, first & (m0 + 3 < M), rel_n,
                           EVEN_K, NORM, HAS_RES, OFFSET, X_DTYPE, NORM_DTYPE, INTERP)
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
    keep_splits: bool = False,
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

    keep_splits: where K is split (`splits`), return the float32 partials [S, M, N] instead
    (no reduction launch): the output is their sum in order s = 0.. rounded to out_dtype, which
    the caller's next kernel computes as it reads them. Unsplit, the output as usual.

    Meant for M = prod(x.shape[:-1]) <= 4 (see `use_gemv`); larger M works but
    re-reads W once per 4 rows. One or two launches, no host synchronisation.
    """
    return _launch(x, weight, config, scales, out_dtype, per_row, keep_splits, None)


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    offset: float,
    weight: torch.Tensor,
    per_row: bool = False,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gemv(rms_norm(x + residual), weight) and x + residual (residual None: rms_norm(x), and
    None), the norm's operands and roundings those of kernels.norm.fused_add_rms_norm /
    rms_norm with `offset`: a decode step's norm before its attention without the norm's launch.
    Every program normalizes the rows it reads (statistic first, over the whole row, from L2).
    x: [M, K] in float32, float16 or bfloat16; weight [N, K] not float8."""
    assert x.dim() == 2 and norm_weight.shape == (x.shape[1],), (tuple(x.shape), tuple(norm_weight.shape))
    x = x.contiguous()
    new_res = None
    if residual is not None:
        assert residual.shape == x.shape, (tuple(residual.shape), tuple(x.shape))
        residual = residual.contiguous()
        new_res = torch.empty_like(x)
    norm_dtype = x.dtype if offset else torch.promote_types(norm_weight.dtype, x.dtype)
    norm = (residual, norm_weight.contiguous(), float(eps), float(offset), new_res, norm_dtype)
    return _launch(x, weight, config, None, norm_dtype, per_row, False, norm), new_res


def splits(m: int, n: int, k: int, device: torch.device, w_bytes: int, per_row: bool = False) -> int:
    """How many K splits `gemv` runs for this shape (1: none)."""
    cfg = gemv_config(1 if per_row else m, n, k, _num_sms(device), w_bytes)
    step = cfg.block_k * cfg.unroll
    return triton.cdiv(k, triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), step) * step)


def _launch(x, weight, config, scales, out_dtype, per_row, keep_splits, norm):
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
    if m == 0 or n == 0 or k == 0:
        assert norm is None or k > 0 or m == 0, "a norm of empty rows"
        return (out if k > 0 else out.zero_()).view(*x.shape[:-1], n)
    sx, sw = _scale_args(scales, m, n, out)
    cfg = config or gemv_config(1 if per_row else m, n, k, _num_sms(x.device), weight.element_size())
    block_m = min(m, rows_per_program(cfg) if per_row else MAX_M)
    step = cfg.block_k * cfg.unroll
    k_split = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), step) * step
    n_splits = triton.cdiv(k, k_split)
    ws = torch.empty((n_splits, m, n), dtype=torch.float32, device=x.device) if n_splits > 1 else out
    dtype = _TL_DTYPES[out_dtype]
    interp = _interpreting()
    pdl = _pdl_enabled(x)
    norm_kw: dict = dict(res_ptr=x2, nw_ptr=x2, nres_ptr=x2)  # (placeholders nothing reads)
    if norm is not None:
        residual, nw, eps, offset, new_res, norm_dtype = norm
        has_res = residual is not None
        norm_kw = dict(
            res_ptr=residual if has_res else x2, nw_ptr=nw, nres_ptr=new_res if has_res else x2, eps=eps,
            stride_rm=residual.stride(0) if has_res else 0, stride_nm=new_res.stride(0) if has_res else 0,
            NORM=True, HAS_RES=has_res, OFFSET=offset, X_DTYPE=_TL_DTYPES[x.dtype], NORM_DTYPE=_TL_DTYPES[norm_dtype],
        )
    grid = (triton.cdiv(n, cfg.block_n), n_splits, triton.cdiv(m, block_m))
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
        SPLIT=n_splits > 1,
        ACC_1D=cfg.acc_1d,
        SCALED=fp8,
        OUT_DTYPE=dtype,
        INTERP=interp,
        PDL=pdl,
        PREFETCH=_prefetch_lines(k_split * weight.element_size(), pdl),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
        **norm_kw,
    )
    if n_splits > 1 and keep_splits:
        return ws
    if n_splits > 1:
        total = m * n
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(total, block),)](
            ws, out, total, SPLITS=n_splits, BLOCK=block, OUT_DTYPE=dtype, INTERP=interp, PDL=pdl, num_warps=4,
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
