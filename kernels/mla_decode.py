"""Triton split-KV decode kernel of multi-head latent attention (kernels/mla.py's paged_mla for
sequences of one query token), and the key-block step it shares with kernels/mla_extend.py.

Grid (head blocks, B, num_splits): a program takes one sequence's query row for BLOCK_H heads,
latent part [BLOCK_H, V] and rope part [BLOCK_H, R], against one range of the sequence's
latent keys read through its page table BLOCK_N at a time: scores = q_lat . c + q_rope .
k_rope (one tl.dot each, float32 accumulation), online softmax in the exp2 domain, acc += p .
c (the values are the keys' first V dims, read once for both). Every head reads the same
keys: the block of heads is what makes the scores a matrix product, and the head blocks of a
(sequence, split) are neighbouring programs, so they stream the same pages together. With
several splits each writes its normalized partial output and log-sum-exp to float32 scratch
and kernels/attention/splits.py's merge (the ordinary decode's) combines them.

The split count comes from shapes only (batch, head blocks, page-table width or a host
bound of the lengths, SM count: splits.py's `_choose_splits`), never from device values, so
the launch is CUDA-graph safe and a graph captured for a batch size always runs the split
count it was captured with; inside the kernel each sequence's keys are divided evenly
between the splits, and a split past its sequence's end writes an empty part (-inf).

V and R must be powers of two (512 and 64 in the released models); R below 16 (tiny test
models) takes a broadcast product instead of tl.dot. p is rounded to the cache's dtype for
the P x V product, as the other attention kernels do; float32 runs "ieee" products. No host
synchronisation.

Tested against kernels/mla.py under TRITON_INTERPRET=1 (tests/kernels/test_mla_decode.py);
the GPU tests (tests/gpu/test_gpu_deepseek.py) have not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.splits import _choose_splits, merge_splits
from kernels.common import TL_DTYPES, interpreting, pdl_enabled, pdl_enter, round_to

LOG2E = 1.4426950408889634

HEAD_BLOCK = 16
"""Heads per decode program (tl.dot's smallest M)."""

SPLIT_KEYS = 64
"""_choose_splits's key-block argument: each split keeps >= 2 x 64 keys. A split's partial
output is 2 KB of float32 per head written and read again by the merge; against 128 keys (147
KB of a bf16 512 + 64 latent, shared by a block of 16 heads) that is under half the bytes."""

PROGRAMS_PER_SM = 2
"""Decode programs resident per SM, for the split count: at 512 + 64 dims (bf16, sm_90a;
benchmarks/ptxas_regs.py mla) a 4-warp program takes 191 registers a thread with splits, 220
without (no spills; 32-key blocks spilled), so 2 fit in an SM's 64K registers."""


@triton.jit
def latent_block(
    q_lat, q_rope, cache_ptr, pt_row, n0, limit, qpos, m_i, l_i, acc, qk_scale, stride_cp, stride_cs,
    V: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, ROPE_DOT: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """One online-softmax update of (m_i, l_i, acc) [rows], [rows], [rows, V] with the keys n0 ..
    n0 + BLOCK_N - 1 (exp2 domain: qk_scale is the softmax scale times log2(e)). MASKED: keys
    at or past `limit` are not read and score -inf; CAUSAL: nor those past the row's qpos
    [rows]. The caller guarantees that every row sees a key in its first block (no -inf - -inf)."""
    n = n0 + tl.arange(0, BLOCK_N)
    dv = tl.arange(0, V)
    dr = tl.arange(0, R)
    if MASKED:
        nmask = n < limit
        page = tl.load(pt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row + n // PAGE).to(tl.int64)
    key = cache_ptr + page * stride_cp + (n % PAGE).to(tl.int64) * stride_cs
    if MASKED:
        c = tl.load(key[:, None] + dv[None, :], mask=nmask[:, None], other=0.0).to(COMPUTE)
        k_rope = tl.load(key[:, None] + V + dr[None, :], mask=nmask[:, None], other=0.0).to(COMPUTE)
    else:
        c = tl.load(key[:, None] + dv[None, :]).to(COMPUTE)
        k_rope = tl.load(key[:, None] + V + dr[None, :]).to(COMPUTE)
    s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
    if ROPE_DOT:
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
    else:
        s += tl.sum(q_rope.to(tl.float32)[:, None, :] * k_rope.to(tl.float32)[None, :, :], axis=2)
    s = s * qk_scale
    if MASKED:
        visible = nmask[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(round_to(p, COMPUTE, INTERP), c, input_precision=PRECISION)
    return m_new, l_i, acc


# The page-table width and split count change from batch to batch, and so does the alignment
# of the slices a mixed step hands over (kernels/mla.py): left to specialize, Triton would
# compile new variants in the middle of serving (as kernels/attention/decode.py notes).
@triton.jit(do_not_specialize=["stride_pb", "num_splits"], do_not_specialize_on_alignment=["pt_ptr", "seq_lens_ptr"])
def _mla_decode_kernel(
    q_ptr, cache_ptr, pt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_cp, stride_cs, stride_pb, stride_ob, stride_oh,
    H, qk_scale, num_splits,
    V: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, COMPUTE: tl.constexpr, OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    ROPE_DOT: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    hmask = heads < H
    length = tl.load(seq_lens_ptr + b).to(tl.int32)
    # this split's keys: the sequence's divided evenly (in BLOCK_N units) over the splits
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    dv = tl.arange(0, V)
    dr = tl.arange(0, R)
    q_row = q_ptr + b * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=hmask[:, None], other=0.0).to(COMPUTE)
    q_rope = tl.load(q_row + V + dr[None, :], mask=hmask[:, None], other=0.0).to(COMPUTE)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, V], dtype=tl.float32)
    pt_row = pt_ptr + b * stride_pb
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = latent_block(
            q_lat, q_rope, cache_ptr, pt_row, n0, end, heads, m_i, l_i, acc, qk_scale, stride_cp, stride_cs,
            V, R, PAGE, BLOCK_N, True, False, COMPUTE, PRECISION, ROPE_DOT, INTERP,
        )  # fmt: skip
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        row = (b * H + heads) * num_splits + split  # [BLOCK_H] rows of [B, H, num_splits]
        tl.store(part_o_ptr + row[:, None] * V + dv[None, :], out, mask=hmask[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=hmask)
    else:
        o_row = out_ptr + b * stride_ob + heads[:, None].to(tl.int64) * stride_oh
        tl.store(o_row + dv[None, :], round_to(out, OUT_DTYPE, INTERP), mask=hmask[:, None])


def supported_dims(v_dim: int, rope_dim: int, dtype: torch.dtype) -> bool:
    """Whether the latent kernels (this and kernels/mla_extend.py) take these dims and dtype."""
    pow2 = v_dim >= 16 and rope_dim > 0 and v_dim & (v_dim - 1) == 0 and rope_dim & (rope_dim - 1) == 0
    return pow2 and dtype in (torch.float32, torch.float16, torch.bfloat16)


def supported(q: torch.Tensor, cache: torch.Tensor, v_dim: int) -> bool:
    """Whether the kernels take these tensors (else paged_mla's torch loop runs): the cache in q's
    dtype or float8 (read into q's)."""
    return supported_dims(v_dim, q.shape[-1] - v_dim, q.dtype) and cache.dtype in (q.dtype, torch.float8_e4m3fn) \
        and cache.stride(-1) == 1 and q.stride(-1) == 1 and cache.stride(2) == cache.shape[-1]


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    # (the interpreter multiplies in float32: it has no 16-bit tl.dot)
    return tl.float32 if dtype == torch.float32 or interpreting() else TL_DTYPES[dtype]


def num_splits_for(batch: int, heads: int, max_seq_len: int, device: torch.device) -> int:
    """The decode's split count: from shapes only (see the module docstring)."""
    return _choose_splits(batch, triton.cdiv(heads, HEAD_BLOCK), max_seq_len, SPLIT_KEYS, device, PROGRAMS_PER_SM)


def mla_decode(
    q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    v_dim: int, max_seq_len: int | None = None, num_splits: int | None = None, split_batch: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence b's one query q[b] [H, V + R] over its seq_lens[b] latent keys (cache [P, S, 1,
    V + R], page_table [B, max_pages]) -> [B, H, V] in q's dtype (written into `out` when
    given: a view with unit stride over V).

    max_seq_len: a host bound of seq_lens, for the split count only (default: the page-table
    width times the page size, as a CUDA graph's fixed table gives). num_splits overrides
    the choice (tests); split_batch: choose as for a batch of this size (1: the rows of a
    verify step, each split as a lone decode of its length is)."""
    bsz, h, _ = q.shape
    if out is None:
        out = torch.empty((bsz, h, v_dim), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    r = q.shape[-1] - v_dim
    page = cache.shape[1]
    if num_splits is None:
        bound = page_table.shape[1] * page if max_seq_len is None else max_seq_len
        num_splits = num_splits_for(split_batch or bsz, h, bound, q.device)
    if num_splits > 1:
        part_o = torch.empty((bsz, h, num_splits, v_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz, h, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # (not written)
    compute = compute_dtype(q.dtype)
    pdl = pdl_enabled(q)
    _mla_decode_kernel[(triton.cdiv(h, HEAD_BLOCK), bsz, num_splits)](
        q, cache, page_table, seq_lens, out, part_o, part_lse,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        h, float(scale) * LOG2E, num_splits,
        V=v_dim, R=r, PAGE=page, BLOCK_H=HEAD_BLOCK, BLOCK_N=32 if v_dim <= 256 else 16, SPLIT=num_splits > 1,
        COMPUTE=compute, OUT_DTYPE=TL_DTYPES[q.dtype], PRECISION="ieee" if compute == tl.float32 else "tf32",
        ROPE_DOT=r >= 16, INTERP=interpreting(), PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(part_o, part_lse, out, out, False, pdl)
    return out
