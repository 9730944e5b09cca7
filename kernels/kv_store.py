"""Triton scatter of new tokens' K/V into the paged cache.

k, v: [T, KVH, D] (any strides with a contiguous last dim); k_cache, v_cache:
[P, S, KVH, D] (v_cache may be token-major: stride 1 over S); slot_mapping: [T], slot = page * S + offset, -1 = skip (padding
of captured CUDA graphs). One launch, no host synchronisation. v and v_cache None: K alone
(latent attention's cache, whose V is K's first dims: kernels/mla.py store_latent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    stride_vcd,
    KVH: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
    CAST: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    HAS_V: tl.constexpr = True,
):
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_h * 0 + slot) >= 0  # [BLOCK_H]; -1 = padding, nothing is written
    mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < D) & valid[:, None]
    slot = tl.maximum(slot, 0)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    if CAST:
        k = _round_to(k.to(tl.float32), CACHE_DTYPE, INTERP)
    kc = kc_ptr + page * stride_kcp + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(kc, k, mask=mask)
    if HAS_V:
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        if CAST:
            v = _round_to(v.to(tl.float32), CACHE_DTYPE, INTERP)
        vc = vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
        tl.store(vc, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into k_cache, v_cache [P, S, KVH, D] at slots [T] (-1 skipped);
    v and v_cache None: k alone."""
    t, kvh, d = k.shape
    has_v = v is not None and v_cache is not None
    if v is None or v_cache is None:  # (the kernel's V pointers are then K's, never read)
        v, v_cache = k, k_cache
    assert v.shape == k.shape and k_cache.shape[-2:] == (kvh, d) and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1  # V: any strides
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if t == 0:
        return
    cast = k.dtype != k_cache.dtype or v.dtype != v_cache.dtype
    assert k_cache.dtype in _TL_DTYPES
    pdl = _pdl_enabled(k)
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        KVH=kvh,
        D=d,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d),
        CACHE_DTYPE=_TL_DTYPES[k_cache.dtype],
        CAST=cast,
        INTERP=_interpreting(),
        PDL=pdl,
        HAS_V=has_v,
        num_warps=4,
        launch_pdl=pdl,
    )
