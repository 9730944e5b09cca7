"""Split-KV paged decode attention: `paged_decode`, one query per sequence.

Grid (KVH, B, num_splits) (KV heads of a sequence are neighbouring programs, so they
stream the same pages at the same time): a program takes all H // KVH query heads of one
KV head (padded to >= 16 rows so the scores are one tl.dot) over one chunk of the
sequence's keys, so every K/V page is read once per KV head. With several splits, each
writes its normalised partial output and log-sum-exp to fp32 scratch and a second small
kernel merges the splits. The split count is chosen on the host from shapes only (batch,
KV heads, page_table width or the `max_seq_len` hint, SM count) - never from device
values - so the launch is CUDA-graph safe; inside the kernel each sequence's keys are
divided evenly between the splits (with a sliding window, only the keys in the window:
see WINDOW in `_decode_kernel`). Over float8 pages a program is one warp, and key blocks
are read as 16-token sub-tiles of pages (`_load_kv_subtiles`; V token-major, as a float8
`PagePool` holds it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.common import (
    _LOG2E,
    _add_sink,
    _cast_in,
    _load_kv_block,
    _load_kv_subtiles,
    _load_pages,
    _output,
    _paged_compute,
    _sinks_arg,
    _softcap,
)
from kernels.attention.splits import _choose_splits
from kernels.attention.splits import merge_splits as _merge_splits
from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to


@triton.jit
def _decode_step(
    q,
    k,
    v,
    t_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    IN_DTYPE: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP: tl.constexpr,
    MASKED: tl.constexpr = True,
    SOFTCAP: tl.constexpr = 0.0,
):
    """One online-softmax update of (m_i, l_i, acc) with a block of keys/values (t_mask:
    the keys that exist and are in the window, read only if MASKED; every block holds at
    least one such key, so no row's maximum stays -inf)."""
    k = _cast_in(k, IN_DTYPE, COMPUTE, INTERP)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP > 0:
        qk = _softcap(qk, SOFTCAP)
    if MASKED:
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _cast_in(v, IN_DTYPE, COMPUTE, INTERP)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
    return m_new, l_i, acc


# The page-table width and split count change from batch to batch; left to specialize, Triton
# would compile new variants (divisible by 16, equal to 1) in the middle of serving. So does
# the alignment of the page table and lengths where a mixed step hands the decode and the
# extend kernel slices of them (kernels.ops.paged_attention): 16-byte aligned or not,
# depending on the number of decodes and the table's width. Each is read one scalar at a
# time, so alignment buys nothing.
@triton.jit(do_not_specialize=["stride_ptb", "num_splits"], do_not_specialize_on_alignment=["pt_ptr", "seq_lens_ptr"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    sinks_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ptb,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    num_splits,
    SPLIT: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    PREFETCH: tl.constexpr,
    SUBTILE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    COMPUTE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # the lengths and the page table come from the step's inputs, not from the kernel before this
    # one (rotary_store writes q and the new token's K and V): read before the PDL wait, their
    # latency overlaps that kernel's end
    if HEAD_MAJOR:  # the KV heads of one sequence are neighbouring programs
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if WINDOW > 0:
        # the query (at seq_len - 1) sees keys lo .. seq_len - 1; the splits divide those, from
        # `base`: lo itself, or for sub-tiles lo rounded down to 16 tokens (still lo's page, as
        # PAGE_SIZE % 16 == 0; the keys before lo are masked). No page before lo's is read.
        lo = tl.maximum(seq_len - WINDOW, 0)
        if SUBTILE:
            base = lo // 16 * 16
        else:
            base = lo
        chunk = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
        start = base + split * chunk
    else:
        # keys of this sequence are divided evenly (in BLOCK_N units) over the splits
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    # a split past the sequence's keys (a short sequence in a graph sized for long ones) reads
    # nothing and writes only its -inf log-sum-exp, which the merge reads as "no partial output"
    # (a vector mask: scalar & vector masks upset the interpreter)
    g_live = offs_g < tl.where(start < end, GROUP, 0)
    _pdl_enter(PDL)
    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_live[:, None] & d_mask[None, :],
        other=0.0,
    )
    if COMPUTE == tl.float16 and IN_DTYPE != tl.float16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
    q = q.to(COMPUTE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pt_row = pt_ptr + b64 * stride_ptb
    if SUBTILE:
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):
            k, v = _load_kv_subtiles(
                k_head, v_head, pt_row, n0, end, stride_kp, stride_ks, stride_vp, stride_vs, stride_vd,
                PAGE_SIZE, BLOCK_N, BLOCK_D, False,
            )  # fmt: skip
            if WINDOW > 0:  # the first block may start before lo
                m_i, l_i, acc = _decode_step(
                    q, k, v, (n0 + offs_n) >= lo, m_i, l_i, acc, qk_scale, IN_DTYPE, COMPUTE, PRECISION, INTERP,
                    True, SOFTCAP,
                )  # fmt: skip
            else:
                m_i, l_i, acc = _decode_step(
                    q, k, v, offs_n, m_i, l_i, acc, qk_scale, IN_DTYPE, COMPUTE, PRECISION, INTERP, False, SOFTCAP
                )
        if full_end < end:
            k, v = _load_kv_subtiles(
                k_head, v_head, pt_row, full_end, end, stride_kp, stride_ks, stride_vp, stride_vs, stride_vd,
                PAGE_SIZE, BLOCK_N, BLOCK_D, True,
            )  # fmt: skip
            t_mask = (full_end + offs_n) < end
            if WINDOW > 0:
                t_mask = t_mask & ((full_end + offs_n) >= lo)
            m_i, l_i, acc = _decode_step(
                q, k, v, t_mask, m_i, l_i, acc, qk_scale, IN_DTYPE, COMPUTE, PRECISION, INTERP, True, SOFTCAP
            )
    elif PREFETCH:
        # software pipelining in registers: while a block is computed, the next block's
        # K/V loads and the page ids of the block after it are in flight
        toks = start + offs_n
        t_mask = toks < end
        page = _load_pages(pt_row, toks, t_mask, PAGE_SIZE)
        k_cur, v_cur = _load_kv_block(
            k_ptr, v_ptr, page, toks, t_mask, kvh, offs_d, d_mask,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, PAGE_SIZE,
        )  # fmt: skip
        toks = toks + BLOCK_N
        page_nx = _load_pages(pt_row, toks, toks < end, PAGE_SIZE)
        for n0 in range(start, end, BLOCK_N):
            toks_nx = n0 + BLOCK_N + offs_n
            k_nx, v_nx = _load_kv_block(
                k_ptr, v_ptr, page_nx, toks_nx, toks_nx < end, kvh, offs_d, d_mask,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, PAGE_SIZE,
            )  # fmt: skip
            toks_nx2 = toks_nx + BLOCK_N
            page_nx = _load_pages(pt_row, toks_nx2, toks_nx2 < end, PAGE_SIZE)
            t_mask = (n0 + offs_n) < end
            m_i, l_i, acc = _decode_step(
                q, k_cur, v_cur, t_mask, m_i, l_i, acc, qk_scale, IN_DTYPE, COMPUTE, PRECISION, INTERP, True, SOFTCAP
            )
            k_cur = k_nx
            v_cur = v_nx
    else:
        for n0 in range(start, end, BLOCK_N):
            toks = n0 + offs_n
            t_mask = toks < end
            page = _load_pages(pt_row, toks, t_mask, PAGE_SIZE)
            k, v = _load_kv_block(
                k_ptr, v_ptr, page, toks, t_mask, kvh, offs_d, d_mask,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, PAGE_SIZE,
            )  # fmt: skip
            m_i, l_i, acc = _decode_step(
                q, k, v, t_mask, m_i, l_i, acc, qk_scale, IN_DTYPE, COMPUTE, PRECISION, INTERP, True, SOFTCAP
            )

    if HAS_SINKS and not SPLIT:
        # with splits, the reduce kernel adds the sink once, to the merged softmax
        l_i, acc = _add_sink(m_i, l_i, acc, tl.load(sinks_ptr + heads, mask=g_mask, other=0.0))
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask_o = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, _round_to(o, OUT_DTYPE, INTERP), mask=mask_o)
    else:
        row = (b64 * H + heads) * num_splits + split  # [BLOCK_G] rows of [B, H, num_splits]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_live[:, None] & d_mask[None, :])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


# decode kernel variant defaults (see paged_decode)
_DECODE_PREFETCH = False
_DECODE_HEAD_MAJOR = True  # measured faster on H200 (3.0 vs 2.5 TB/s at B=64, L=2048)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool | None = None,
    head_major: bool | None = None,
    compute_dtype: torch.dtype | None = None,
    maxnreg: int | None = None,
    subtile: bool | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    split_batch: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged K/V. q: [B, H, D] -> [B, H, D]
    (written into `out` when given: a [B, H, D] view with unit stride over D).

    window > 0: the query sees only the last `window` keys, and the splits divide those
    (no page wholly before them is read: its page-table entry may be stale). softcap > 0:
    scores s become softcap * tanh(s / softcap). sinks: float32 [H], gpt-oss's attention
    sinks (one extra logit per query head in the softmax, with no value; added once, when the
    splits are merged). See `kernels.reference.paged_attention`.

    max_seq_len: optional host hint (an upper bound of seq_lens) used only to pick the
    split count; by default the page-table width times the page size. num_splits,
    block_n, num_warps, num_stages override the heuristics; prefetch (register double
    buffering of K/V instead of Triton's pipeliner) and head_major (the KV heads of a
    sequence are neighbouring programs) select kernel variants (tuning/tests).
    compute_dtype: the dtype of the tensor-core dots (default: see `_decode_compute`).
    maxnreg: a cap on the registers per thread (more programs resident per SM; 0: none).
    subtile: address whole key blocks as 16-token sub-tiles of pages (default: float8
    pages; needs a page size and block that are multiples of 16 and a power-of-2 head_dim).
    v_cache may be token-major (stride 1 over the page's tokens, see `PagePool`).
    split_batch: choose the split count as for a batch of this size (1: the rows of a verify
    step, each split as a lone decode of its length is, so that their outputs are that
    decode's bit for bit; the key ranges of a split depend on the row's own length only).
    """
    batch, h, d = q.shape
    _, page_size, kvh, dk = k_cache.shape
    assert dk == d and h % kvh == 0 and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1  # V: any strides
    assert window >= 0 and softcap >= 0
    if q.stride(-1) != 1:
        q = q.contiguous()
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    out = _output(out, q)
    sinks_t = _sinks_arg(sinks, q)
    if batch == 0:
        return out
    group = h // kvh
    block_d = triton.next_power_of_2(d)
    fp8_pages = k_cache.dtype == torch.float8_e4m3fn and not _interpreting()
    split_block = None  # the key block the split count is chosen by (default: block_n)
    if block_n is None:
        block_n = 64 if q.dtype != torch.float32 or _interpreting() else 32
        if block_d > 128 or fp8_pages:
            block_n = 32
        elif (split_batch or batch) * kvh <= 8 and not _interpreting():
            # a lone sequence (W2): its few programs each wait on one K/V block at a time, so
            # finer blocks give more splits work at short contexts, while the split count stays
            # that of 64-key blocks (splits of >= 128 keys: a 2,048-token graph runs 16, not 32).
            # H100, Qwen3-30B-A3B's 4 KV heads, 16 splits: 4.13 against 4.87 us with 64-key
            # blocks at 256 keys, 4.19 against 4.99 at 384; 32 splits of 32 keys: 4.81, 4.85
            # (profile_gpu.py attn-b1)
            block_n, split_block = 32, 64
    if max_seq_len is None:
        max_seq_len = page_table.shape[1] * page_size
    if window > 0:
        max_seq_len = min(max_seq_len, window)  # the keys a query sees: what the splits divide
    if subtile is None:
        subtile = k_cache.dtype == torch.float8_e4m3fn
    subtile = subtile and page_size % 16 == 0 and block_n % 16 == 0 and block_d == d
    if prefetch is None:
        prefetch = _DECODE_PREFETCH
    if head_major is None:
        head_major = _DECODE_HEAD_MAJOR
    if num_warps is None:
        # float8 pages: one warp per program, no cross-warp softmax and operand exchange per
        # key block (that, not bytes, bound 4 warps: 355 us at batch 256 and 1,500 tokens with
        # float8 or bf16 pages alike; one warp with 32-key blocks 298 us, and 515 against 684
        # us at batch 512; profile_gpu.py attn-fp8). bf16 pages are at the bandwidth floor
        # with 4 warps already.
        num_warps = 1 if fp8_pages else 4
    if maxnreg is None and fp8_pages and num_warps == 1 and not subtile:
        # 168 registers per thread left 12 one-warp programs per SM; capped at 128 (2-4
        # spilled), 16 fit: 313 against 356 us at batch 256, 538 against 551 at 480, over
        # 1,000-2,000 tokens (profile_gpu.py attn-occ; a cap of 96 spilled 20-50 and was slower).
        # The sub-tiled kernel (~237 registers, 8 programs per SM) was fastest uncapped: 389
        # against 427 us at 128 and 406 at 168 (batch 480; profile_gpu.py attn-subtile).
        maxnreg = 128
    if num_stages is None:
        num_stages = 1 if prefetch else 3  # 3: 7% faster than 2 at B=128-256 (H200 sweep)
    if num_splits is None:
        # the one-warp float8 kernel fits 8 programs per SM: batch 64 x 1,000-2,000 tokens
        # took 87 us in 2 splits against 97 in 1 (profile_gpu.py attn-subtile)
        per_sm = 8 if fp8_pages and num_warps == 1 else 4
        num_splits = _choose_splits(split_batch or batch, kvh, max_seq_len, split_block or block_n, q.device, per_sm)
    block_g = max(16, triton.next_power_of_2(group))
    if num_splits > 1:
        part_o = torch.empty((batch, h, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, h, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    compute = _paged_compute(q, k_cache) if compute_dtype is None else _TL_DTYPES[compute_dtype]
    interp = _interpreting()
    pdl = _pdl_enabled(q)
    grid = (kvh, batch, num_splits) if head_major else (batch, kvh, num_splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, page_table, seq_lens, out, part_o, part_lse, sinks_t,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        H=h, GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size, num_splits=num_splits,
        SPLIT=num_splits > 1, HEAD_MAJOR=head_major, PREFETCH=prefetch, SUBTILE=subtile,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        IN_DTYPE=_TL_DTYPES[q.dtype], COMPUTE=compute, OUT_DTYPE=_TL_DTYPES[q.dtype],
        PRECISION="ieee" if compute == tl.float32 else "tf32",
        INTERP=interp, PDL=pdl, WINDOW=int(window), SOFTCAP=float(softcap), HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    if num_splits > 1:
        _merge_splits(part_o, part_lse, out, sinks_t, sinks is not None, pdl)
    return out
