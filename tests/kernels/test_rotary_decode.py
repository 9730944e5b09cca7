"""Decode attention that rotates q and stores the new token's K/V itself (`paged_decode(...,
rope=Rope(...))`): the same output and cache bits as `rope.rotary_store` then `paged_decode`,
whatever the split count, grouping, q/k norms, window, page size or cache layout."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import attention, rope
from kernels.rope import Rope
from tests.kernels.device import DEVICE
from tests.kernels.test_kernels import _cos_sin, _paged_cache, _same_bits, head_major, token_major

PAD = 1
"""A CUDA graph's padding row: slot -1, length 1 (streamer/model/graphs.py)."""


def _case(lens, page_size, kvh, gqa, d, dtype, seed):
    """Un-rotated q, k, v (strided views of one projection), positions, slots of each sequence's
    last token, cos/sin, caches and page table of a decode step; row PAD is padding."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc, pt = _paged_cache(lens, page_size, kvh, d, dtype, gen)
    h = kvh * gqa
    qkv = torch.randn(len(lens), h + 2 * kvh, d, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    last = seq_lens.long() - 1
    slots = (pt.long().gather(1, (last // page_size)[:, None])[:, 0] * page_size + last % page_size).int()
    slots[PAD] = -1
    return q, k, v, last, slots, _cos_sin(512, d).to(DEVICE), kc, vc, pt, seq_lens


def _both(case, qk_norm, layout=None, **kw):
    """(output, K cache, V cache) of rotary_store + paged_decode, and of the fused decode."""
    q, k, v, positions, slots, cs, kc, vc, pt, lens = case
    scale = 1 / math.sqrt(q.shape[-1])
    results = []
    for fused in (False, True):
        kcache, vcache = kc.clone(), vc.clone()
        if layout is not None:
            kcache, vcache = head_major(kcache), token_major(vcache)
        if fused:
            out = attention.paged_decode(q, kcache, vcache, pt, lens, scale,
                                         rope=Rope(k, v, positions, cs, slots, qk_norm), **kw)
        else:
            q_rot = rope.rotary_store(q, k, v, positions, cs, kcache, vcache, slots, qk_norm)
            out = attention.paged_decode(q_rot, kcache, vcache, pt, lens, scale, **kw)
        results.append((out, kcache, vcache))
    return results


def _norms(kind, d, dtype):
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(5)
    qw, kw = ((1 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE) for _ in range(2))
    return qw, kw, 1e-6, 1.0 if kind == "gemma3" else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("gqa,norm", [(1, None), (4, "qwen3"), (8, "gemma3")])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fused_decode_gives_the_bits_of_rotary_store_then_decode(dtype, num_splits, gqa, norm, page_size):
    d = 64
    case = _case([9, 1, 40, 17, 2], page_size, 2, gqa, d, dtype, seed=gqa)
    (out, kc, vc), (out_f, kc_f, vc_f) = _both(case, _norms(norm, d, dtype), num_splits=num_splits, block_n=16)
    assert torch.equal(kc_f, kc) and torch.equal(vc_f, vc)  # the new tokens stored; the padding row stores nothing
    assert torch.equal(out_f, out)


@pytest.mark.parametrize("window", [0, 10])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_decode_with_a_window_softcap_and_sinks(window, num_splits):
    d = 128
    case = _case([30, 1, 64, 5], 16, 1, 4, d, torch.bfloat16, seed=3)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    (out, kc, vc), (out_f, kc_f, vc_f) = _both(case, None, num_splits=num_splits, window=window, softcap=30.0,
                                               sinks=sinks)
    assert torch.equal(kc_f, kc) and torch.equal(vc_f, vc)
    assert torch.equal(out_f, out)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_decode_into_float8_pages(num_splits):
    """Float8 pages in a PagePool's layouts (K head-major, V token-major): the new token's K/V
    rounded to e4m3 as rotary_store rounds them, then read back through the sub-tiles."""
    d = 64
    case = _case([20, 1, 50], 16, 2, 4, d, torch.bfloat16, seed=7)
    fp8 = list(case)
    fp8[6], fp8[7] = case[6].to(torch.float8_e4m3fn), case[7].to(torch.float8_e4m3fn)
    (out, kc, vc), (out_f, kc_f, vc_f) = _both(tuple(fp8), _norms("qwen3", d, torch.bfloat16), layout="pool",
                                               num_splits=num_splits)
    assert _same_bits(kc_f, kc) and _same_bits(vc_f, vc)
    assert torch.equal(out_f, out)
