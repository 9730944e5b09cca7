"""Float8 (e4m3) KV pages: the store kernel rounds and saturates like torch's cast, and
the attention kernels read float8 pages as the reference does (`.to(q.dtype)`).

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import attention, kv_store, reference
from tests.kernels.device import DEVICE
from tests.kernels.test_kernels import (
    ATTN_TOL,
    EXTEND_MIX,
    _close,
    _decode_case,
    _extend_case,
    head_major,
    token_major,
)

FP8 = torch.float8_e4m3fn
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
def test_store_rounds_and_saturates_like_torch(dtype):
    """Every magnitude float8 holds, with its subnormals (< 2^-6), values that round up to the
    next power of two (7.9 -> 8) and values past the largest finite one (448)."""
    gen = torch.Generator().manual_seed(0)
    t, kvh, d = 24, 2, 32
    scale = torch.logspace(-4, 3, t)[:, None, None]  # 1e-4 ... 1000
    k = (torch.randn(t, kvh, d, generator=gen) * scale).to(dtype)
    v = (torch.randn(t, kvh, d, generator=gen) * scale).to(dtype)
    k[0, 0, :4] = torch.tensor([7.9, -7.95, 1000.0, -449.0]).to(dtype)
    slots = torch.randperm(40, generator=gen)[:t].int()
    slots[3] = -1  # padding: not written
    kc, vc, kr, vr = (torch.zeros(10, 4, kvh, d, dtype=FP8) for _ in range(4))
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    kc, vc = head_major(kc), token_major(vc)  # as a float8 PagePool holds them
    kv_store.store_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
    reference.store_kv(k, v, kr, vr, slots)
    for out, ref, x in ((kc.cpu(), kr, k), (vc.cpu(), vr, v)):
        differ = out.view(torch.uint8) != ref.view(torch.uint8)
        # the inputs of the differing bytes, in slot order, for the failure message
        x_at = torch.zeros(40, kvh, d, dtype=dtype)
        x_at[slots[slots >= 0].long()] = x[slots >= 0]
        x_at = x_at.view_as(out)
        assert not differ.any(), list(
            zip(x_at[differ][:8].tolist(), out[differ][:8].float().tolist(), ref[differ][:8].float().tolist())
        )
    assert kc.float().abs().max() == 448.0 and not kc.float().isnan().any()


def _fp8(*caches):
    return [c.to(FP8) for c in caches]


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("v_layout", ["d-major", "token-major", "pool"])
def test_decode_reads_fp8_pages(dtype, num_splits, v_layout):
    """Float8 pages of either V layout, or the pool's (V token-major, K head-major); the
    default path reads whole blocks as sub-tiles."""
    q, kc, vc, pt, lens = _decode_case([1, 17, 40, 64, 130], 16, 4, 64, dtype, seed=1)
    kc, vc = _fp8(kc, vc)
    if v_layout != "d-major":
        vc = token_major(vc)
    if v_layout == "pool":
        kc = head_major(kc)
    out = attention.paged_decode(q, kc, vc, pt, lens, 0.125, num_splits=num_splits)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125), ATTN_TOL[dtype])


def test_decode_fp16_dots_read_every_fp8_value():
    """bf16 queries over float8 pages multiply in fp16 on the GPU (forced here on CPU too),
    with V holding every float8 byte but NaN, subnormals and +-448 included, and queries
    past fp16's range (saturated), against the reference."""
    q, kc, vc, pt, lens = _decode_case([1, 17, 40, 200], 16, 4, 64, torch.bfloat16, seed=2)
    kc, vc = _fp8(kc, vc)
    q[0, 0, :2] = torch.tensor([1e6, -1e6])  # bf16 holds them; fp16 saturates them at 65504
    every = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    flat = vc.view(torch.uint8).view(-1)
    flat[: flat.numel() // every.numel() * every.numel()] = every.repeat(flat.numel() // every.numel())
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    ref = reference.paged_attention(q, kc, vc, pt, lens, cu, 0.125)
    for num_splits in (1, 3):
        out = attention.paged_decode(q, kc, vc, pt, lens, 0.125, num_splits=num_splits, compute_dtype=torch.float16)
        _close(out, ref, ATTN_TOL[torch.bfloat16])


@DTYPES
@pytest.mark.parametrize("v_layout", ["d-major", "token-major", "pool"])
def test_extend_reads_fp8_pages(dtype, v_layout):
    prefixes, q_lens = EXTEND_MIX
    q, kc, vc, pt, lens, cu = _extend_case(prefixes, q_lens, 16, 4, 64, dtype, kvh=2)
    kc, vc = _fp8(kc, vc)
    if v_layout != "d-major":
        vc = token_major(vc)
    if v_layout == "pool":
        kc = head_major(kc)
    scale = 1 / math.sqrt(64)
    out = attention.paged_extend(q, kc, vc, pt, lens, cu, scale, max(q_lens))
    _close(out, reference.paged_attention(q, kc, vc, pt, lens, cu, scale), ATTN_TOL[dtype])
