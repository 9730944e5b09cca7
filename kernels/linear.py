"""Triton skinny GEMM for decode steps: y = x @ w.T (+ b) with few rows in x.

At batch 1-16 a linear layer is a pass over its weight: the whole cost is
reading w once, and cuBLAS reaches only 2-3.7 TB/s on some of a Llama-3.1-8B
layer's shapes at M = 1 (4096x4096: 2.0 TB/s, measured on the H200), with a
second split-K reduction kernel. Here each program owns BLOCK_N output columns
for all rows (padded to BLOCK_M >= 16 so the product is one tl.dot), walks the
whole K dimension, and writes its outputs directly: w is read exactly once,
and there is one launch per layer.

`use_skinny` decides from shapes only (so it is CUDA-graph safe): few rows, and
enough column blocks to fill the SMs without splitting K.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import round_to as _round_to

MAX_ROWS = 16
ENABLED = True
"""ops.linear uses the skinny kernel where use_skinny says so (off: always cuBLAS)."""


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x.to(COMPUTE), tl.trans(w.to(COMPUTE)), input_precision="ieee" if INTERP else "tf32")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, _round_to(acc, OUT_DTYPE, INTERP), mask=m_mask[:, None] & n_mask[None, :])


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    return 16, 512, 4, 4


def use_skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Shapes only: few rows, a 16-bit weight, and at least two column blocks per SM."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or w.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.dtype != w.dtype or w.stride(-1) != 1:
        return False
    block_n = default_config(w.shape[0], w.shape[1])[0]
    sms = _sm_count(w.device.index if w.device.index is not None else torch.cuda.current_device())
    return triton.cdiv(w.shape[0], block_n) >= 2 * sms


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N] in x.dtype, for M <= MAX_ROWS."""
    m, k = x.shape
    n, k2 = w.shape
    assert k == k2 and m <= MAX_ROWS
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w.stride(-1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bn, bk, nw, ns = default_config(n, k)
    bn, bk = block_n or bn, block_k or bk
    bk = min(bk, triton.next_power_of_2(k))
    interp = _interpreting()
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x,
        w,
        bias if bias is not None else w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=16,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN_K=k % bk == 0,
        COMPUTE=tl.float32 if interp or x.dtype == torch.float32 else _TL_DTYPES[x.dtype],
        OUT_DTYPE=_TL_DTYPES[x.dtype],
        INTERP=interp,
        num_warps=num_warps or nw,
        num_stages=num_stages or ns,
    )
    return out
