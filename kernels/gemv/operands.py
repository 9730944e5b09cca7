"""The GEMV's input chunks, loaded in the W tile's register layout: x's (`x_chunk`), or for
`norm_gemv` those of rms_norm(x + residual) (`x_in`, with the row's statistic `row_rstd`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.common import round_to as _round_to


@triton.jit
def x_chunk(row_ptr, offs_n, offs_k, k_left, EVEN_K: tl.constexpr):
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
def row_rstd(x_row, r_row, offs_n, offs_k, K, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             HAS_RES: tl.constexpr, X_DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """1 / sqrt(mean((x + r)^2) + eps) of the whole row (K values, whatever this program's
    split), x + r rounded to X_DTYPE first as kernels/norm.py's fused add + RMSNorm."""
    sq = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        xs = x_chunk(x_row + k, offs_n, offs_k, K - k, False)
        if HAS_RES:
            xs = _round_to(xs + x_chunk(r_row + k, offs_n, offs_k, K - k, False), X_DTYPE, INTERP).to(tl.float32)
        sq += xs * xs
    # (every row of the tile holds the same values: one row's sum)
    return 1.0 / tl.sqrt(tl.max(tl.sum(sq, axis=1), axis=0) / K + eps)


@triton.jit
def x_in(x_row, r_row, nres_row, nw_row, kk, offs_n, offs_k, k_left, rstd, store_res, rel_n, EVEN_K: tl.constexpr,
         NORM: tl.constexpr, HAS_RES: tl.constexpr, OFFSET: tl.constexpr, X_DTYPE: tl.constexpr,
         NORM_DTYPE: tl.constexpr, INTERP: tl.constexpr, DEFER: tl.constexpr):
    """The GEMV's input chunk at kk: x's (`x_chunk`), or with NORM rms_norm(x + r)'s, rounded
    as kernels/norm.py rounds (so the product is that of the norm's stored output). store_res:
    this program stores x + r of its chunks (one program per row and split: the first row of the
    tile of program column 0, rel_n its rows' index in the tile; `lim` masks the rest).
    DEFER (a program over the whole row): the statistic is not known yet, so the chunk is
    (x + r) * w unscaled, in fp32, and its squares come back for the row's sum (else the
    second value is the first): the caller multiplies the product by the statistic at the end."""
    xs = x_chunk(x_row + kk, offs_n, offs_k, k_left, EVEN_K)
    if NORM:
        if HAS_RES:
            xs = _round_to(xs + x_chunk(r_row + kk, offs_n, offs_k, k_left, EVEN_K), X_DTYPE, INTERP)
            lim = tl.where(store_res, 1, 0)  # (scalar & vector masks upset the interpreter)
            keep = (rel_n < lim)[:, None] & (offs_k < k_left)[None, :]
            tl.store(nres_row + kk + offs_k[None, :] + (offs_n * 0)[:, None], xs, mask=keep)
            xs = xs.to(tl.float32)
        nw = x_chunk(nw_row + kk, offs_n, offs_k, k_left, EVEN_K)
        if DEFER:
            sq = xs * xs
            if OFFSET != 0.0:
                xs = xs * (OFFSET + nw)
            else:
                xs = xs * nw
            return xs, sq
        if OFFSET != 0.0:
            xs = _round_to((xs * rstd) * (OFFSET + nw), X_DTYPE, INTERP).to(tl.float32)
        else:
            xs = _round_to(nw * _round_to(xs * rstd, X_DTYPE, INTERP).to(tl.float32), NORM_DTYPE, INTERP)
            xs = xs.to(tl.float32)
    return xs, xs
