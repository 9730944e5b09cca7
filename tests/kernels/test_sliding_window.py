"""Sliding-window attention and score soft-capping: the torch reference equals a naive dense
masked softmax, and the decode and extend kernels equal the reference. A window hides the
keys more than `window` positions behind each query; the scheduler releases the pages wholly
before a sequence's window and leaves stale ids in their page-table entries, so no kernel
(nor the reference) may read those pages.

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention, reference
from tests.kernels.device import DEVICE
from tests.kernels.test_kernels import ATTN_TOL, _close, _decode_case, _extend_case, head_major, token_major

FP32_TOL = ATTN_TOL[torch.float32]
# (cached prefix, new tokens): a fresh prefill, a single token, a chunk after a prefix, a
# prefill of exactly 64 tokens, and a chunk far past a 64-token window
PREFIXES, Q_LENS = [0, 0, 26, 44, 100], [7, 1, 33, 20, 20]


def _decode_cu(q):
    return torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)


def _naive(q, k_cache, v_cache, page_table, seq_lens, cu_q_lens, scale, window, softcap):
    """Every query's scores over all of its sequence's keys in float64, masked to
    i - window < j <= i, softmax, times V: the definition, with no pages skipped."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    h, kvh = q.shape[1], k_cache.shape[2]
    for b, length in enumerate(seq_lens.tolist()):
        q0, q1 = cu_q_lens[b].item(), cu_q_lens[b + 1].item()
        k = reference.gather_kv(k_cache, page_table[b], length).double().repeat_interleave(h // kvh, 1)
        v = reference.gather_kv(v_cache, page_table[b], length).double().repeat_interleave(h // kvh, 1)
        i = torch.arange(length - (q1 - q0), length, device=q.device)[:, None, None]  # query positions
        s = torch.einsum("thd,jhd->thj", q[q0:q1].double(), k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        j = torch.arange(length, device=q.device)
        s = s.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
        out[q0:q1] = torch.einsum("thj,jhd->thd", torch.softmax(s, -1), v)
    return out


def _poison_before_window(k_cache, v_cache, page_table, seq_lens, q_lens, window):
    """A copy of page_table whose entries wholly before each sequence's window (for all of its
    queries in the call) name a spare page full of NaN, as a released and reused page may be."""
    page_size = k_cache.shape[1]
    used = set(page_table.flatten().tolist())
    nan_page = next(p for p in range(k_cache.shape[0]) if p not in used)  # _paged_cache leaves spares
    k_cache[nan_page] = float("nan")
    v_cache[nan_page] = float("nan")
    stale = page_table.clone()
    poisoned = 0
    for b, (length, ql) in enumerate(zip(seq_lens.tolist(), q_lens)):
        first_page = max(0, length - ql - window + 1) // page_size
        stale[b, :first_page] = nan_page
        poisoned += first_page
    assert poisoned > 0
    return stale


def test_reference_with_window_and_softcap_equals_naive_masked_softmax():
    """Windows below, at and above the sequences' lengths (64 is one prefill's), with and
    without soft-capping, over pages of 4 tokens and grouped KV heads."""
    q, kc, vc, pt, lens, cu = _extend_case(PREFIXES, Q_LENS, 4, 2, 16, torch.float32)
    for window, softcap in ((1, 0.0), (5, 0.0), (64, 0.0), (200, 0.0), (5, 2.0)):
        ref = reference.paged_attention(q, kc, vc, pt, lens, cu, 0.5, window, softcap)
        _close(ref, _naive(q, kc, vc, pt, lens, cu, 0.5, window, softcap), 1e-5)
    # and one query per sequence (the decode shape)
    q, kc, vc, pt, lens = _decode_case([1, 7, 33, 100], 4, 2, 16, torch.float32)
    ref = reference.paged_attention(q, kc, vc, pt, lens, _decode_cu(q), 0.5, 7)
    _close(ref, _naive(q, kc, vc, pt, lens, _decode_cu(q), 0.5, 7, 0.0), 1e-5)


DECODE_CASES = [
    # page_size, window, kernel options: per-token loads (page size 1) over 3 splits; one
    # split; 16-token sub-tiles whose first starts before the window (masked); the register
    # prefetch variant; the split count the heuristic picks from the window
    (1, 5, dict(num_splits=3)),
    (16, 33, dict(num_splits=1)),
    (16, 5, dict(num_splits=3, subtile=True, block_n=16)),
    (1, 33, dict(prefetch=True, num_splits=2)),
    (16, 40, dict(subtile=True)),
]


@pytest.mark.parametrize("page_size,window,options", DECODE_CASES)
def test_decode_with_window_matches_reference(page_size, window, options):
    """Lengths 1, 7, 33 and 100: windows larger than, equal to and smaller than them in one
    batch; 4 query heads per KV head."""
    q, kc, vc, pt, lens = _decode_case([1, 7, 33, 100], page_size, 4, 64, torch.float32, seed=1)
    out = attention.paged_decode(q, kc, vc, pt, lens, 0.125, window=window, **options)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, _decode_cu(q), 0.125, window), FP32_TOL)


EXTEND_CASES = [
    # page_size, window, kernel options: a 64-token window over 16-query, 16-key blocks, so
    # query blocks far into a sequence have all three key ranges (window edge, unmasked,
    # diagonal); a window narrower than a query block over 16-token sub-tiles; the tile list
    # of a CUDA-graph step
    (1, 64, dict(block_m=16, block_n=16)),
    (16, 5, dict(subtile=True, block_n=16)),
    (16, 40, dict(block_m=16, tiles=True)),
]


@pytest.mark.parametrize("page_size,window,options", EXTEND_CASES)
def test_extend_with_window_matches_reference(page_size, window, options):
    q, kc, vc, pt, lens, cu = _extend_case(PREFIXES, Q_LENS, page_size, 4, 64, torch.float32, kvh=1, seed=2)
    if options.pop("tiles", False):
        tiles = attention.extend_tiles(Q_LENS, options["block_m"], pad_to=12)
        options["tiles"] = torch.from_numpy(tiles).to(DEVICE)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, max(Q_LENS), window=window, **options)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125, window), FP32_TOL)


def test_softcap_with_and_without_window_matches_reference():
    """Queries scaled up so that scores reach 3x the cap of 50: capping changes the output."""
    scale, cap = 0.125, 50.0
    q, kc, vc, pt, lens = _decode_case([7, 100], 16, 4, 64, torch.float32, seed=3)
    q = q * 20
    cu = _decode_cu(q)
    ref = reference.paged_attention(q, kc, vc, pt, lens, cu, scale, 0, cap)
    assert (ref - reference.paged_attention(q, kc, vc, pt, lens, cu, scale)).abs().max() > 0.1
    _close(attention.paged_decode(q, kc, vc, pt, lens, scale, num_splits=2, softcap=cap), ref, FP32_TOL)
    ref = reference.paged_attention(q, kc, vc, pt, lens, cu, scale, 20, cap)
    _close(attention.paged_decode(q, kc, vc, pt, lens, scale, window=20, softcap=cap), ref, FP32_TOL)

    q, kc, vc, pt, lens, cu = _extend_case([0, 30], [20, 9], 16, 4, 64, torch.float32, kvh=1, seed=4)
    q = q * 20
    for window in (0, 12):
        ref = reference.paged_attention(q, kc, vc, pt, lens, cu, scale, window, cap)
        out = attention.paged_extend(q, kc, vc, pt, lens, cu, scale, 20, block_n=16, window=window, softcap=cap)
        _close(out, ref, FP32_TOL)


@pytest.mark.parametrize("v_layout", ["token-major", "pool"])
def test_float8_pages_with_window_and_softcap(v_layout):
    """bf16 queries over float8 pages (V token-major, and K head-major too as a float8
    PagePool holds them: sub-tiled by default) with a window and a cap."""
    fp8 = torch.float8_e4m3fn
    q, kc, vc, pt, lens = _decode_case([7, 40, 100], 16, 4, 64, torch.bfloat16, seed=5)
    kc, vc = kc.to(fp8), token_major(vc.to(fp8))
    if v_layout == "pool":
        kc = head_major(kc)
    ref = reference.paged_attention(q, kc, vc, pt, lens, _decode_cu(q), 0.125, 24, 5.0)
    _close(attention.paged_decode(q, kc, vc, pt, lens, 0.125, num_splits=2, window=24, softcap=5.0), ref, 2e-2)

    q, kc, vc, pt, lens, cu = _extend_case([0, 30], [20, 9], 16, 4, 64, torch.bfloat16, kvh=1, seed=6)
    kc, vc = kc.to(fp8), token_major(vc.to(fp8))
    if v_layout == "pool":
        kc = head_major(kc)
    ref = reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125, 24, 5.0)
    _close(attention.paged_extend(q, kc, vc, pt, lens, cu, 0.125, 20, window=24, softcap=5.0), ref, 2e-2)


@pytest.mark.parametrize("page_size,subtile", [(1, False), (16, True)])
def test_pages_wholly_before_the_window_are_never_read(page_size, subtile):
    """Page-table entries before each sequence's window name a page of NaN: the reference
    and both kernels give the output of the intact table (finite). Page size 1 makes every
    key before the window such a page; 16-token sub-tiles round the window's start down."""
    window = 20
    q, kc, vc, pt, lens = _decode_case([1, 33, 100], page_size, 4, 64, torch.float32, seed=7)
    want = reference.paged_attention(q, kc, vc, pt, lens, _decode_cu(q), 0.125, window)
    stale = _poison_before_window(kc, vc, pt, lens, [1] * 3, window)
    ref = reference.paged_attention(q, kc, vc, stale, lens, _decode_cu(q), 0.125, window)
    out = attention.paged_decode(q, kc, vc, stale, lens, 0.125, num_splits=3, subtile=subtile, window=window)
    assert ref.isfinite().all() and out.isfinite().all()
    _close(ref, want, 0.0)
    _close(out, want, FP32_TOL)

    q, kc, vc, pt, lens, cu = _extend_case([0, 30, 60], [20, 9, 36], page_size, 4, 64, torch.float32, kvh=1, seed=8)
    want = reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125, window)
    stale = _poison_before_window(kc, vc, pt, lens, [20, 9, 36], window)
    ref = reference.paged_attention(q, kc, vc, stale, lens, cu, 0.125, window)
    out = attention.paged_extend(q, kc, vc, stale, lens, cu, 0.125, 36, block_m=16, block_n=16, subtile=subtile,
                                 window=window)  # fmt: skip
    assert ref.isfinite().all() and out.isfinite().all()
    _close(ref, want, 0.0)
    _close(out, want, FP32_TOL)
