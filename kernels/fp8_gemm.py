"""Float8 linear layers at a few dozen to a few hundred rows (quantization "fp8", per-token
activation scales, per-row weight scales): y[m, n] = sx[m] * sw[n] * sum_k q[m, k] * w[n, k],
accumulated in fp32 on float8 tensor cores and rounded once to the output dtype, the formula of
torch._scaled_mm's row-wise GEMM (streamer/model/quant.py's fp8_linear). On Hopper the tensor cores
first sum each instruction's 32 products to about 14 bits, as cuBLAS's do: off by up to ~3e-5 of the
products' absolute sum (tests/kernels/test_fp8_gemm.py, SUMS).

Why not cuBLAS there: its row-wise float8 GEMM runs 128 x 128 tiles whatever M is, so a layer
with few output tiles leaves most of the card idle. At W8's ~133 rows on the Qwen3-30B-A3B shape
qkv (N 5,120) is 40 tiles and o (N 2,048) 16 on a 132-SM card, and each call took 12.8 us for
10.5 MB of weights (0.8 TB/s; benchmarks/RESULTS.md, thirty-first and thirty-fourth sessions).
Smaller tiles here give every SM work; `use_triton` keeps cuBLAS wherever its own tiles already
fill the card (wide layers such as an 8B model's gate_up) and past MAX_ROWS rows.

Programs along the grid's first axis are the row blocks of one column block: they read the same
weight tile at about the same time, so a second row block finds it in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import (
    TL_DTYPES,
    interpreting,
    pdl_enabled,
    pdl_enter,
    prefetch_l2,
    prefetch_lines,
    round_to,
    sm_count,
)

MAX_ROWS = 256
"""Most rows `use_triton` sends here (past it the layer is compute-bound and cuBLAS's tiles fill the card)."""

CUBLAS_TILE = 128
"""The edge of the row-wise float8 GEMM's tiles cuBLAS picks at these sizes (nvjet ..._128x128_..., profiles)."""


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
                     PRECISION: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
                     PREFETCH: tl.constexpr = 0):
    """out[BLOCK_M rows, BLOCK_N columns] = the scaled float8 product (module docstring), K in
    BLOCK_K chunks (K need not divide: the tail is masked to zeros)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(0) == 0:  # (the weights, once per column block: no kernel before writes them)
        prefetch_l2(w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn, K, PREFETCH)
    pdl_enter(PDL)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    # W [N, K] read as [BLOCK_K, BLOCK_N] with K contiguous: both float8 operands K-major, as the
    # tensor cores take them
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        a = tl.load(a_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs + k, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a.to(COMPUTE), b.to(COMPUTE), acc, input_precision=PRECISION)
    sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, round_to(y, DTYPE, INTERP), mask=m_mask[:, None] & n_mask[None, :])


def use_triton(m: int, n: int, device: torch.device) -> bool:
    """True where this kernel should replace cuBLAS's row-wise float8 GEMM: CUDA, 1 < M <= MAX_ROWS
    (one row goes to the float8 GEMV), and cuBLAS's 128 x 128 tiles would not give every SM one."""
    if device.type != "cuda" or not 1 < m <= MAX_ROWS:
        return False
    return triton.cdiv(m, CUBLAS_TILE) * triton.cdiv(n, CUBLAS_TILE) < sm_count(device)


STAGES = {128: 4, 256: 3}
"""Pipeline stages by BLOCK_K (256-wide K chunks: 3 stages fit the shared memory, 4 do not pay)."""


def tiles(m: int, n: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows up to 16, else 64 (masked rows cost nothing a weight-bound
    layer notices: at 32 rows 64-row blocks ran 1.3-1.4x faster than 32-row ones); 64 columns where that
    already makes a program per SM, else 32; at 64 rows, 256-wide K chunks where the programs are fewer
    than the SMs (twice the bytes in flight a program: 1.2-1.8x there), else 128. Measured on an H100,
    benchmarks/fp8_gemm_bench.py (benchmarks/RESULTS.md, thirty-seventh session)."""
    bm = 16 if m <= 16 else 64
    bn = 64 if triton.cdiv(m, bm) * triton.cdiv(n, 64) >= sms else 32
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    bk = 256 if bm == 64 and programs < sms else 128
    return bm, bn, bk


def fp8_gemm(q: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             out_dtype: torch.dtype, block: tuple[int, int, int] | None = None, num_warps: int = 4,
             num_stages: int | None = None) -> torch.Tensor:
    """q float8 [M, K] (rows scaled by sx fp32 [M] or [M, 1]) times weight float8 [N, K] (rows
    scaled by weight_scale fp32 [N]) -> [M, N] in out_dtype. block: (BLOCK_M, BLOCK_N, BLOCK_K),
    default `tiles`; num_stages default STAGES[BLOCK_K]."""
    m, k = q.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and q.dtype == weight.dtype == torch.float8_e4m3fn, (tuple(q.shape), tuple(weight.shape))
    assert q.stride(-1) == 1 and weight.stride(-1) == 1
    sx = sx.reshape(-1)
    sw = weight_scale.reshape(-1)
    assert sx.shape == (m,) and sw.shape == (n,) and sx.dtype == sw.dtype == torch.float32
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0 or n == 0:
        return out
    interp = interpreting()
    pdl = pdl_enabled(q)
    bm, bn, bk = block or tiles(m, n, sm_count(q.device) if q.is_cuda else 4)
    # the interpreter's float8 dot: exact fp32 products of the float8 values (a compiled float8
    # dot needs K chunks of at least 32)
    compute = tl.float32 if interp else tl.float8e4nv
    assert interp or bk >= 32, bk
    _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        q, weight, sx, sw, out, m, n, k, q.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, COMPUTE=compute, PRECISION="ieee" if interp else "tf32",
        DTYPE=TL_DTYPES[out_dtype], INTERP=interp, PDL=pdl, PREFETCH=prefetch_lines(k, pdl), num_warps=num_warps,
        num_stages=num_stages or STAGES.get(bk, 4), launch_pdl=pdl,
    )  # fmt: skip
    return out
