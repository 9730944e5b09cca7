"""Causal varlen paged attention: `paged_extend`, packed queries of prefill / extend steps.

Grid (cdiv(max_q_len, BLOCK_M), H, B), or (len(tiles), H) with a tile list (see
`extend_tiles`): the grid then depends only on the tile list's length, so a CUDA graph
captured for a padded token count serves any batch that fits. Query i of sequence b sits
at position seq_lens[b] - q_len_b + i and sees keys up to its own position (its K/V must
already be in the pages). Blocks of keys entirely before the query block run without
masks; the rest apply the causal mask. With a sliding window (WINDOW) a query block starts
at its first query's window and masks that edge too; SOFTCAP soft-caps the scores; HAS_SINKS
adds a per-head sink logit to each row's softmax, once, at the final normalization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.common import (
    _LOG2E,
    _add_sink,
    _cast_in,
    _load_kv_subtiles,
    _output,
    _paged_compute,
    _sinks_arg,
    _softcap,
)
from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to


@triton.jit
def _extend_inner(
    acc,
    l_i,
    m_i,
    q,
    qpos,
    k_ptr,
    v_ptr,
    pt_row,
    kvh,
    lo,
    hi,
    seq_len,
    qk_scale,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    offs_n,
    offs_d,
    d_mask,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    SUBTILE: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    """Online-softmax updates with the keys lo .. hi - 1 (BLOCK_N at a time). With MASKED, keys
    at or past `seq_len` (an upper bound: the caller may pass a smaller one) are not read, and
    the causal mask and with WINDOW > 0 the window's lower edge apply; without, every row sees
    every key."""
    for n0 in range(lo, hi, BLOCK_N):
        toks = n0 + offs_n
        if MASKED:
            t_mask = toks < seq_len
        if SUBTILE:
            k, v = _load_kv_subtiles(
                k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, pt_row, n0, seq_len,
                stride_kp, stride_ks, stride_vp, stride_vs, stride_vd, PAGE_SIZE, BLOCK_N, BLOCK_D, MASKED,
            )  # fmt: skip
        else:
            if MASKED:
                page = tl.load(pt_row + toks // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
                kv_mask = t_mask[:, None] & d_mask[None, :]
            else:
                page = tl.load(pt_row + toks // PAGE_SIZE).to(tl.int64)
                kv_mask = d_mask[None, :]
            in_page = (toks % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        k = _cast_in(k, IN_DTYPE, COMPUTE, INTERP)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP > 0:
            qk = _softcap(qk, SOFTCAP)
        if MASKED:
            visible = (toks[None, :] <= qpos[:, None]) & t_mask[None, :]
            if WINDOW > 0:
                visible = visible & (toks[None, :] > qpos[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED and WINDOW > 0:
            # a row may see none of a block's keys while it has seen none before either
            # (m_new = -inf): subtract 0 then, not -inf (-inf - -inf is NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(qk - m_sub[:, None])
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _cast_in(v, IN_DTYPE, COMPUTE, INTERP)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(
    do_not_specialize=["stride_ptb"], do_not_specialize_on_alignment=["pt_ptr", "seq_lens_ptr", "cu_ptr", "tiles_ptr"]
)
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pt_ptr,
    seq_lens_ptr,
    cu_ptr,
    tiles_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ptb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    COMPUTE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP: tl.constexpr,
    TILED: tl.constexpr,
    SUBTILE: tl.constexpr,
    PDL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    _pdl_enter(PDL)
    h = tl.program_id(1)
    if TILED:
        # one program per (sequence, query block) of the tile list; -1 pads it
        tile = tl.load(tiles_ptr + tl.program_id(0))
        live = tile >= 0
        b = tl.where(live, tile >> 16, 0)
        mb = tile & 0xFFFF
    else:
        live = True
        mb = tl.program_id(0)
        b = tl.program_id(2)
    q_start = tl.load(cu_ptr + b).to(tl.int32)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int32) - q_start
    if live & (mb * BLOCK_M < q_len):
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        prefix = seq_len - q_len
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        qpos = prefix + offs_m
        tok = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if COMPUTE == tl.float16 and IN_DTYPE != tl.float16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
        q = q.to(COMPUTE)
        kvh = h // GROUP
        pt_row = pt_ptr + b.to(tl.int64) * stride_ptb

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first = prefix + mb * BLOCK_M
        full_end = (first // BLOCK_N) * BLOCK_N
        if WINDOW > 0:
            # Three ranges of keys, none before the page of lo, the block's lowest visible key:
            #   [lo, mid)        window edge: masked (and bounded by mid, not seq_len)
            #   [mid, diag)      seen by every row: no mask; whole blocks ending at diag
            #   [diag, end)      the causal diagonal: masked
            # mid >= max(first + BLOCK_M - WINDOW, 0), the lowest key the block's last row sees.
            # Sub-tiles start at multiples of 16: lo rounded down stays in lo's page.
            lo = tl.maximum(first - WINDOW + 1, 0)
            if SUBTILE:
                lo = lo // 16 * 16
            diag = tl.maximum(full_end, lo)
            seen_by_all = tl.maximum(first + BLOCK_M - WINDOW, 0)
            mid = diag - tl.maximum((diag - seen_by_all) // BLOCK_N, 0) * BLOCK_N
            acc, l_i, m_i = _extend_inner(
                acc, l_i, m_i, q, qpos, k_ptr, v_ptr, pt_row, kvh, lo, mid, mid, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, BLOCK_D, True, SUBTILE, IN_DTYPE, COMPUTE, PRECISION, INTERP, WINDOW, SOFTCAP,
            )  # fmt: skip
            acc, l_i, m_i = _extend_inner(
                acc, l_i, m_i, q, qpos, k_ptr, v_ptr, pt_row, kvh, mid, diag, seq_len, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, BLOCK_D, False, SUBTILE, IN_DTYPE, COMPUTE, PRECISION, INTERP, WINDOW, SOFTCAP,
            )  # fmt: skip
            end = tl.minimum(first + BLOCK_M, seq_len)
            acc, l_i, m_i = _extend_inner(
                acc, l_i, m_i, q, qpos, k_ptr, v_ptr, pt_row, kvh, diag, end, seq_len, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, BLOCK_D, True, SUBTILE, IN_DTYPE, COMPUTE, PRECISION, INTERP, WINDOW, SOFTCAP,
            )  # fmt: skip
        else:
            # keys before the block's first query position are seen by every row: no mask
            acc, l_i, m_i = _extend_inner(
                acc, l_i, m_i, q, qpos, k_ptr, v_ptr, pt_row, kvh, 0, full_end, seq_len, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, BLOCK_D, False, SUBTILE, IN_DTYPE, COMPUTE, PRECISION, INTERP, 0, SOFTCAP,
            )  # fmt: skip
            end = tl.minimum(first + BLOCK_M, seq_len)
            acc, l_i, m_i = _extend_inner(
                acc, l_i, m_i, q, qpos, k_ptr, v_ptr, pt_row, kvh, full_end, end, seq_len, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, BLOCK_D, True, SUBTILE, IN_DTYPE, COMPUTE, PRECISION, INTERP, 0, SOFTCAP,
            )  # fmt: skip
        if HAS_SINKS:
            l_i, acc = _add_sink(m_i, l_i, acc, tl.load(sinks_ptr + h))
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            _round_to(o, OUT_DTYPE, INTERP),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tiles: torch.Tensor | None = None,
    subtile: bool | None = None,
    compute_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries q [T, H, D] over paged K/V -> [T, H, D] (written
    into `out` when given, as in `paged_decode`).

    window > 0: a query at position i sees keys i - window < j <= i; a query block reads
    keys from its first query's window on, no page wholly before that. softcap > 0: scores s
    become softcap * tanh(s / softcap). sinks: float32 [H], gpt-oss's attention sinks (one
    extra logit per query head in the softmax, with no value). See
    `kernels.reference.paged_attention`.

    max_q_len: host-known upper bound of the per-sequence query counts (sizes the grid).
    tiles: optional int32 list from `extend_tiles(q_lens, block_m)` (padding -1), with
    block_m its block size; the grid is then (len(tiles), H) whatever the batch.
    v_cache may be token-major (stride 1 over the page's tokens, see `PagePool`).
    subtile: address key blocks as 16-token sub-tiles of pages (see `paged_decode`; default:
    when V is token-major).
    compute_dtype: the dtype of the tensor-core dots (default: see `_paged_compute`).
    """
    t, h, d = q.shape
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
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0 or max_q_len <= 0:
        return out
    block_d = triton.next_power_of_2(d)
    compute = _paged_compute(q, k_cache) if compute_dtype is None else _TL_DTYPES[compute_dtype]
    big = compute != tl.float32 and block_d <= 128
    if tiles is not None:
        assert block_m is not None, "a tile list is built for one block size"
    if block_m is None:
        block_m = extend_block_m(q.dtype, d)
        block_m = min(block_m, max(16, triton.next_power_of_2(max_q_len)))
    if block_n is None:
        block_n = 64 if big else 32
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2
    if subtile is None:
        subtile = v_cache.stride(1) == 1 and page_size > 1
    subtile = subtile and page_size % 16 == 0 and block_n % 16 == 0 and block_d == d
    if tiles is not None:
        grid: tuple[int, ...] = (tiles.shape[0], h)
    else:
        grid = (triton.cdiv(max_q_len, block_m), h, batch)
    pdl = _pdl_enabled(q)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        cu_q_lens,
        cu_q_lens if tiles is None else tiles,
        out,
        sinks_t,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=h // kvh,
        HEAD_DIM=d,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IN_DTYPE=_TL_DTYPES[q.dtype],
        COMPUTE=compute,
        OUT_DTYPE=_TL_DTYPES[q.dtype],
        PRECISION="ieee" if compute == tl.float32 else "tf32",
        INTERP=_interpreting(),
        PDL=pdl,
        TILED=tiles is not None,
        SUBTILE=subtile,
        WINDOW=int(window),
        SOFTCAP=float(softcap),
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return out


def extend_block_m(dtype: torch.dtype, head_dim: int) -> int:
    """The default query block of paged_extend: 64 for 16-bit inputs on the GPU, else 32."""
    big = dtype in (torch.bfloat16, torch.float16) and not _interpreting() and triton.next_power_of_2(head_dim) <= 128
    return 64 if big else 32


def extend_tiles(q_lens, block_m: int, pad_to: int = 0):
    """The tile list of paged_extend (numpy int32): sequence b's query block m is
    b << 16 | m, one per block with queries; then -1 up to pad_to entries.
    At most cdiv(sum(q_lens), block_m) + len(q_lens) tiles."""
    import numpy as np

    q_lens = np.asarray(q_lens, dtype=np.int64)
    blocks = -(-q_lens // block_m)
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int64), blocks)
    first = np.cumsum(blocks) - blocks
    m = np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(first, blocks)
    assert len(q_lens) < 1 << 15 and (m < 1 << 16).all()
    tiles = np.full(max(pad_to, len(seq)), -1, dtype=np.int32)
    tiles[: len(seq)] = (seq << 16) | m
    return tiles
