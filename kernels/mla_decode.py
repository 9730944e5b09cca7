"""Triton decode kernel of multi-head latent attention (kernels/mla.py's paged_mla for
sequences of one query token).

One program per (sequence, block of BLOCK_H heads): its one query row per head, latent part
[BLOCK_H, V] and rope part [BLOCK_H, R], against the sequence's latent keys read through
its page table BLOCK_N at a time: scores = q_lat . c + q_rope . k_rope (one tl.dot each,
float32 accumulation), online softmax, acc += p . c (the values are the keys' first V dims,
read once for both). Every head reads the same keys: the block of heads is what makes the
scores a matrix product. V and R must be powers of two (512 and 64 in the released models);
R below 16 (tiny test models) takes a broadcast product instead of tl.dot. p is rounded to
the cache's dtype for the P x V product, as the other attention kernels do; float32 runs
"ieee" products. No host synchronisation in the kernel itself.

Tested against kernels/mla.py under TRITON_INTERPRET=1 (tests/kernels/test_mla_decode.py);
the GPU tests (tests/gpu/test_gpu_deepseek.py) have not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES, interpreting, round_to


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, page_table_ptr, seq_lens_ptr, rows_ptr, out_ptr,
    stride_qt, stride_qh, stride_cp, stride_cs, stride_pb, stride_ot, stride_oh,
    H, scale,
    V: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr, OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROPE_DOT: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    t = tl.load(rows_ptr + b).to(tl.int64)
    length = tl.load(seq_lens_ptr + b)
    dv = tl.arange(0, V)
    dr = tl.arange(0, R)
    q_row = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=hmask[:, None], other=0.0).to(COMPUTE)
    q_rope = tl.load(q_row + V + dr[None, :], mask=hmask[:, None], other=0.0).to(COMPUTE)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, V], dtype=tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < length
        page = tl.load(page_table_ptr + b * stride_pb + n // PAGE, mask=nmask, other=0).to(tl.int64)
        key = cache_ptr + page * stride_cp + (n % PAGE).to(tl.int64) * stride_cs
        c = tl.load(key[:, None] + dv[None, :], mask=nmask[:, None], other=0.0).to(COMPUTE)
        k_rope = tl.load(key[:, None] + V + dr[None, :], mask=nmask[:, None], other=0.0).to(COMPUTE)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        if ROPE_DOT:
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        else:
            s += tl.sum(q_rope.to(tl.float32)[:, None, :] * k_rope.to(tl.float32)[None, :, :], axis=2)
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(round_to(p, COMPUTE, INTERP), c, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_row = out_ptr + b * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    tl.store(o_row + dv[None, :], round_to(out, OUT_DTYPE, INTERP), mask=hmask[:, None])


def supported(q: torch.Tensor, cache: torch.Tensor, v_dim: int) -> bool:
    """Whether the kernel takes these shapes (else paged_mla's torch loop runs)."""
    r = q.shape[-1] - v_dim
    pow2 = v_dim >= 16 and r > 0 and v_dim & (v_dim - 1) == 0 and r & (r - 1) == 0
    return pow2 and cache.dtype == q.dtype and cache.stride(-1) == 1 and q.stride(-1) == 1 \
        and cache.stride(2) == cache.shape[-1] and q.dtype in TL_DTYPES


def mla_decode(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
               rows: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    """Sequence b's one query, q[rows[b]] [H, V + R], over its seq_lens[b] latent keys
    (cache [P, S, 1, V + R], page_table [B, max_pages]) -> [B, H, V] in q's dtype."""
    bsz, h = rows.shape[0], q.shape[1]
    out = torch.empty((bsz, h, v_dim), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    r = q.shape[-1] - v_dim
    block_h = 16  # (tl.dot's smallest M)
    # (the interpreter multiplies in float32: it has no 16-bit tl.dot)
    compute = tl.float32 if q.dtype == torch.float32 or interpreting() else TL_DTYPES[q.dtype]
    _mla_decode_kernel[(bsz, triton.cdiv(h, block_h))](
        q, cache, page_table, seq_lens, rows, out,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        h, scale,
        V=v_dim, R=r, PAGE=cache.shape[1], BLOCK_H=block_h, BLOCK_N=32 if v_dim <= 256 else 16,
        COMPUTE=compute, OUT_DTYPE=TL_DTYPES[q.dtype], PRECISION="ieee" if compute == tl.float32 else "tf32",
        ROPE_DOT=r >= 16, INTERP=interpreting(),
        num_warps=4,
    )  # fmt: skip
    return out
