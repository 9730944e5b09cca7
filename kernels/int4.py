"""4-bit weight-only linear layers (W4A16): y[M, N] = x[M, K] @ W^T with W dequantized from
int4 in the kernels' K loop, fp32 accumulation, y in x's dtype.

The one layout (streamer/model/int4_checkpoint.py repacks AWQ, GPTQ and compressed-tensors
checkpoints into it at load):

- `qweight` int32 [N, K / 8]: row n holds W's row n, eight 4-bit values per word in order
  along K (value k is bits 4 * (k % 8) .. + 3 of word k // 8), unsigned 0..15;
- `scales` [N, K / G] in x's dtype and `zeros` uint8 [N, K / G] (0..16: GPTQ v1's stored
  zero + 1 may reach 16): W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G],
  computed in fp32 and rounded to x's dtype once (what `dequantize` gives the reference).

Rows along N like nn.Linear's weight, so that the parts of a fused q/k/v or gate/up layer
are row ranges of every tensor. K must be a multiple of G and G of 16 (the GEMM's K tile,
which divides G so that a tile has one scale and zero per row, is at least tl.dot's 16).

`int4_gemm` (any M, tl.dot on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles of dequantized W)
serves prefill and batches; `int4_gemv` (a few rows; each row its own program along the grid's
third axis, so a row's result does not depend on the others: a verify step's rows equal
decode's) serves decode, streaming [BLOCK_N, BLOCK_K] tiles of W with elementwise FMAs
like kernels/gemv; from DEQUANT_ROWS rows W is dequantized whole (`dequantize_weight`) for a
cuBLAS GEMM. `linear` picks one; `reference_linear` is the torch path (CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES, interpreting, round_to

GEMV_ROWS = 16
"""Most rows `linear` sends to the GEMV (a verify step's rows, each computed as decode's one)."""


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in dtype from the int4 layout (module docstring)."""
    n = qweight.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight.unsqueeze(-1) >> shifts) & 0xF).reshape(n, -1)
    z = zeros.to(torch.int32).repeat_interleave(group, dim=1)
    s = scales.float().repeat_interleave(group, dim=1)
    return ((q - z).float() * s).to(dtype)


def reference_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group: int) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(qweight, scales, zeros, group, x.dtype))


@triton.jit
def _nibble(p, j: tl.constexpr, zf, s):
    """(nibble j of each word - zero) * scale in fp32, with no int-to-float conversion (a quarter-rate
    instruction): the nibble ORed into 2^23's mantissa is the float 2^23 + q, and zf = 2^23 + zero
    (exact integers: the difference is q - zero exactly)."""
    q = (((p >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    return (q - zf) * s


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, rows, k0, stride_wn, stride_sn, G: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """W[rows, k0 : k0 + BLOCK_K] as fp32 [BLOCK_N, BLOCK_K] (k0 a multiple of BLOCK_K, which divides G).

    The words are loaded whole ([BLOCK_N, BLOCK_K / 8], vectorized) and each nibble becomes its own
    [BLOCK_N, BLOCK_K / 8] tensor in the same registers; tl.join stacks the eight along new minor
    dimensions, ordered so that the row-major flattening is k = 8 * word + nibble, which keeps every
    value in the thread that loaded its word (a shift-and-reshape of one [N, W, 8] tensor moved them
    through shared memory and spilled: benchmarks/RESULTS.md, thirty-second session)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    p = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + words[None, :], eviction_policy="evict_first")
    g = k0 // G
    s = tl.load(s_ptr + rows.to(tl.int64) * stride_sn + g).to(tl.float32)[:, None]
    zf = tl.load(z_ptr + rows.to(tl.int64) * stride_sn + g).to(tl.float32)[:, None] + 8388608.0  # 2^23 + zero
    if BLOCK_K >= 32:
        # t[n, w, a, b, c] = nibble 4a + 2b + c of word w
        t = tl.join(tl.join(tl.join(_nibble(p, 0, zf, s), _nibble(p, 4, zf, s)),
                            tl.join(_nibble(p, 2, zf, s), _nibble(p, 6, zf, s))),
                    tl.join(tl.join(_nibble(p, 1, zf, s), _nibble(p, 5, zf, s)),
                            tl.join(_nibble(p, 3, zf, s), _nibble(p, 7, zf, s))))
        return tl.reshape(t, (BLOCK_N, BLOCK_K))
    # two words a row (a group of 16): compiled, the joins' reshape fed wrong values to a 16-bit tl.dot (H100,
    # Triton 3.9: thirty-second session), so these few values go the shift-and-reshape way
    q = (p[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    q = (tl.reshape(q, (BLOCK_N, BLOCK_K)) | 0x4B000000).to(tl.float32, bitcast=True)
    return (q - zf) * s


@triton.jit
def _int4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # tail rows re-read row N - 1; the store masks them
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    m_mask = (offs_m < M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=m_mask, other=0.0)
        # W rounded to x's dtype, as the reference's dequantized weight is, then a tensor-core dot
        w = round_to(_dequant_tile(w_ptr, s_ptr, z_ptr, rows, k0, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K), DTYPE, INTERP)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    mask = m_mask & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, round_to(acc, DTYPE, INTERP), mask=mask)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):  # UNROLL tiles' words in flight at once (a tile is few bytes)
            k = k0 + u * BLOCK_K
            w = round_to(_dequant_tile(w_ptr, s_ptr, z_ptr, rows, k, stride_wn, stride_sn, G, BLOCK_N, BLOCK_K), DTYPE,
                         INTERP)
            # (x loaded in W's register layout, rows sharing addresses: see kernels/gemv/linear.py _x_chunk)
            xv = tl.load(x_ptr + m * stride_xm + k + offs_k[None, :] + (offs_n * 0)[:, None],
                         eviction_policy="evict_last")
            acc += w.to(tl.float32) * xv.to(tl.float32)
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + m * stride_om + offs_n, round_to(y, DTYPE, INTERP), mask=offs_n < N)


def unroll(k: int, block_k: int, most: int = 8) -> int:
    """The GEMVs' K tiles per loop iteration: the largest count <= most that divides K's tiles."""
    tiles = k // block_k
    return next(u for u in range(min(most, tiles), 0, -1) if tiles % u == 0)


def _block_k(group: int, cap: int) -> int:
    """The largest power of two <= cap dividing the group (each K tile inside one group)."""
    b = 16
    while b * 2 <= cap and group % (b * 2) == 0:
        b *= 2
    return b


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> None:
    n, k = qweight.shape[0], x.shape[-1]
    assert qweight.dtype == torch.int32 and qweight.shape[1] * 8 == k, (tuple(qweight.shape), k)
    assert group % 16 == 0 and k % group == 0, (group, k)
    assert scales.shape == zeros.shape == (n, k // group), (tuple(scales.shape), tuple(zeros.shape))
    assert scales.dtype == x.dtype and zeros.dtype == torch.uint8 and x.dtype in TL_DTYPES
    assert qweight.stride(-1) == scales.stride(-1) == zeros.stride(-1) == 1
    assert scales.stride(0) == zeros.stride(0)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              block: tuple[int, int, int] | None = None, num_warps: int = 4, num_stages: int | None = None
              ) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype. block: (BLOCK_M, BLOCK_N, BLOCK_K); BLOCK_K
    must divide the group. Default: up to 16 rows, 16 x 32 x 128 in 4 stages, the fastest of eight
    tiles at M 2-16 on the H100 for Llama-3.1-8B's layers (benchmarks/int4_bench.py small,
    thirty-second session: at M 4 the four layers took 182 us against 279 with 16 x 64 x 64); more
    rows, up to 64 rows by 128 columns by a K tile of up to 64 in 3 stages."""
    _check(x, qweight, scales, zeros, group)
    n, k = qweight.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        few = m <= 16
        bm, bn, bk = block or ((16, 32, _block_k(group, 128)) if few else
                               (min(64, triton.next_power_of_2(m)), 128, _block_k(group, 64)))
        num_stages = num_stages or (4 if few else 3)
        assert group % bk == 0 and bk % 16 == 0, (group, bk)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _int4_gemm_kernel[grid](x2, qweight, scales, zeros, out, m, n, k, x2.stride(0), qweight.stride(0),
                                scales.stride(0), out.stride(0), G=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                DTYPE=TL_DTYPES[x.dtype], INTERP=interpreting(), num_warps=num_warps,
                                # (fp32 x: full-precision products, not tf32, as the reference)
                                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                num_stages=num_stages)
    return out.view(*x.shape[:-1], n)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              block: tuple[int, int] | None = None, num_warps: int | None = None, most_unroll: int = 8) -> torch.Tensor:
    """int4_gemm's result for a few rows of x, each row computed alone (block: BLOCK_N,
    BLOCK_K; a K tile of up to 256 that divides the group: a thread's share of a tile is whole
    int32 words, 8 weights each; up to most_unroll tiles per loop iteration, `unroll`). Default
    tiles, the fastest of nine on the H100 for Llama-3.1-8B's layers (benchmarks/int4_bench.py gemv,
    thirty-second session): 16 rows on 8 warps up to K 8,192 (qkv 24.5 us against 28.5 on 4 warps),
    8 rows on 4 warps beyond (down, K 14,336: 63.5 against 118)."""
    _check(x, qweight, scales, zeros, group)
    n, k = qweight.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        wide = k > 8192
        bn, bk = block or (8 if wide else 16, _block_k(group, 256))
        num_warps = num_warps or (4 if wide else 8)
        assert group % bk == 0 and bk % 8 == 0, (group, bk)
        _int4_gemv_kernel[(triton.cdiv(n, bn), m)](x2, qweight, scales, zeros, out, n, k, x2.stride(0),
                                                  qweight.stride(0), scales.stride(0), out.stride(0), G=group,
                                                  BLOCK_N=bn, BLOCK_K=bk, UNROLL=unroll(k, bk, most_unroll),
                                                  DTYPE=TL_DTYPES[x.dtype], INTERP=interpreting(),
                                                  num_warps=num_warps)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, G: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = round_to(_dequant_tile(w_ptr, s_ptr, z_ptr, tl.minimum(offs_n, N - 1), k0, stride_wn, stride_sn, G, BLOCK_N,
                               BLOCK_K), DTYPE, INTERP)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + k0 + tl.arange(0, BLOCK_K)[None, :]
    tl.store(out, w, mask=(offs_n < N)[:, None])


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """`dequantize` in one kernel: W [N, K] in dtype, each value rounded once as the reference's."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    assert group % 16 == 0 and k % group == 0 and scales.shape == zeros.shape == (n, k // group), (group, k)
    assert qweight.stride(-1) == scales.stride(-1) == zeros.stride(-1) == 1 and scales.stride(0) == zeros.stride(0)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    bk = _block_k(group, 128)
    _dequant_kernel[(triton.cdiv(n, 32), k // bk)](qweight, scales, zeros, out, n, qweight.stride(0), scales.stride(0),
                                                   out.stride(0), G=group, BLOCK_N=32, BLOCK_K=bk,
                                                   DTYPE=TL_DTYPES[dtype], INTERP=interpreting())
    return out


DEQUANT_ROWS = 1024
"""Rows from which `linear` writes W out in x's dtype (`dequantize_weight`) and multiplies with cuBLAS: the
reference's arithmetic exactly. At M = 1,024 on the H100 the int4 GEMM took 2.5-2.9x bf16 cuBLAS's time for
Llama-3.1-8B's layers (841 against 342 us for gate_up), and writing gate_up's 235 MB of bf16 is ~0.1 ms at the
card's bandwidth (benchmarks/RESULTS.md, thirty-second session; the dequantization itself not yet timed there:
int4_bench.py's "dequant" column)."""


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
           per_row: bool = False) -> torch.Tensor:
    """The W4A16 layer on CUDA: the GEMV for one row (or up to GEMV_ROWS with per_row: each
    row as if alone, bit for bit), W dequantized whole and cuBLAS from DEQUANT_ROWS rows, the
    GEMM otherwise."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 1 or (per_row and rows <= GEMV_ROWS):
        return int4_gemv(x, qweight, scales, zeros, group)
    if rows >= DEQUANT_ROWS:
        return torch.nn.functional.linear(x, dequantize_weight(qweight, scales, zeros, group, x.dtype))
    return int4_gemm(x, qweight, scales, zeros, group)
