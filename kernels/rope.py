"""Triton neox-style (rotate-half) rotary embedding for q and k in one launch; and
`rotary_store`, which also writes the rotated k and v into the paged KV cache (16-bit or
float8 pages).

Matches `kernels.reference.rotary`: cos/sin are rounded to q.dtype, and
`x * cos` and `rotate_half(x) * sin` are each rounded to q.dtype before the add,
as the torch ops do. Returns new contiguous tensors (the inputs are not
modified). One launch, no host synchronisation (CUDA-graph safe).
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
def _scale_normed(x, inv, w, OFFSET: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """x * inv (its RMS) times the norm weight, rounded as kernels.reference.rms_norm: offset 0,
    weight * normed with the normed rounded first; else normed * (offset + weight) in float32,
    rounded once (Gemma)."""
    if OFFSET == 0.0:
        return _round_to(w * _round_to(x * inv, DTYPE, INTERP).to(tl.float32), DTYPE, INTERP).to(tl.float32)
    return _round_to(x * inv * (OFFSET + w), DTYPE, INTERP).to(tl.float32)


@triton.jit
def _rotate(
    x_ptr,
    o_ptr,
    t,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos,
    sin,
    sel,
    NH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    norm_ptr=None,
    eps=0.0,
    NORM: tl.constexpr = False,
    NORM_OFFSET: tl.constexpr = 0.0,
):
    """Rotate the NH heads of token t of x into o (o row t); nothing is stored if sel < 0.
    OUT_DTYPE: o's dtype; the rotated values are rounded to DTYPE first, as `rotary` then
    `kv_store.store_kv` would store them. NORM: each head RMS-normalized first with the
    weight at norm_ptr (Qwen3's and Gemma 3's q/k norms, rounded as kernels.reference.rms_norm)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NH) & (offs_d[None, :] < HALF)
    base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = _scale_normed(x1, inv, w1, NORM_OFFSET, DTYPE, INTERP)
        x2 = _scale_normed(x2, inv, w2, NORM_OFFSET, DTYPE, INTERP)
    a1 = _round_to(x1 * cos, DTYPE, INTERP).to(tl.float32)
    b1 = _round_to(-x2 * sin, DTYPE, INTERP).to(tl.float32)
    a2 = _round_to(x2 * cos, DTYPE, INTERP).to(tl.float32)
    b2 = _round_to(x1 * sin, DTYPE, INTERP).to(tl.float32)
    obase = o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    mask = mask & ((offs_h * 0 + sel) >= 0)[:, None]  # (a scalar mask trips the interpreter)
    o1 = _round_to(a1 + b1, DTYPE, INTERP)
    o2 = _round_to(a2 + b2, DTYPE, INTERP)
    if OUT_DTYPE != DTYPE:
        o1 = _round_to(o1.to(tl.float32), OUT_DTYPE, INTERP)
        o2 = _round_to(o2.to(tl.float32), OUT_DTYPE, INTERP)
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)


@triton.jit
def _cos_sin_of(pos_ptr, cs_ptr, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """cos and sin rows [1, BLOCK_HALF] of token t's position, rounded to DTYPE."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0)
    cos = _round_to(cos.to(tl.float32), DTYPE, INTERP).to(tl.float32)[None, :]
    sin = _round_to(sin.to(tl.float32), DTYPE, INTERP).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin_of(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF, DTYPE, INTERP)
    _rotate(
        q_ptr,
        qo_ptr,
        t,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        t,
        H,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        DTYPE,
        INTERP,
        DTYPE,
    )
    _rotate(
        k_ptr,
        ko_ptr,
        t,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        t,
        KVH,
        HALF,
        BLOCK_KVH,
        BLOCK_HALF,
        DTYPE,
        INTERP,
        DTYPE,
    )


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D], positions: [T], cos_sin: [max_pos, D] fp32 -> (q', k')."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape[0] == t and k.shape[2] == d and d % 2 == 0
    assert k.dtype == q.dtype
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    positions = positions.reshape(-1)
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    half = d // 2
    if t > 0:
        pdl = _pdl_enabled(q)
        _rotary_kernel[(t,)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos_sin.stride(0),
            H=h,
            KVH=kvh,
            HALF=half,
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_KVH=triton.next_power_of_2(kvh),
            BLOCK_HALF=triton.next_power_of_2(half),
            DTYPE=_TL_DTYPES[q.dtype],
            INTERP=_interpreting(),
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return q_out, k_out


@triton.jit
def _rotary_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    slot_ptr,
    cs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_cos,
    qn_ptr,
    kn_ptr,
    eps,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DTYPE: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
):
    """Program (t, part): token t's q heads (part 0), its k heads to their cache slot (1) or its
    v heads to theirs (2). Three programs a token rather than one doing the three in turn: at a
    decode step of a few tokens each part is a chain of dependent loads and stores, and one
    program ran the chains one after the other."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    # the position, its cos/sin row and the slot are step inputs and a table (no kernel before this
    # one writes them): two dependent loads read before the PDL wait, while the q/k/v GEMV ends
    cos, sin = _cos_sin_of(pos_ptr, cs_ptr, t, stride_cos, HALF, BLOCK_HALF, DTYPE, INTERP)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    _pdl_enter(PDL)
    # the rotated k and the v of token t go straight to their cache slot (-1: padding, skipped)
    safe = tl.maximum(slot, 0)
    page = safe // PAGE_SIZE
    off = safe % PAGE_SIZE
    if part == 0:
        _rotate(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, t,
                H, HALF, BLOCK_H, BLOCK_HALF, DTYPE, INTERP, DTYPE, qn_ptr, eps, NORM, NORM_OFFSET)
    elif part == 1:
        _rotate(k_ptr + t * stride_kt, kc_ptr + page * stride_kcp + off * stride_kcs, 0, 0, stride_kh, 0,
                stride_kch, cos, sin, slot, KVH, HALF, BLOCK_KVH, BLOCK_HALF, DTYPE, INTERP, CACHE_DTYPE, kn_ptr,
                eps, NORM, NORM_OFFSET)
    else:
        offs_h = tl.arange(0, BLOCK_KVH)
        offs_f = tl.arange(0, 2 * BLOCK_HALF)
        ok = (offs_h * 0 + slot) >= 0
        vmask = (offs_h[:, None] < KVH) & (offs_f[None, :] < 2 * HALF) & ok[:, None]
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_f[None, :], mask=vmask)
        if CACHE_DTYPE != DTYPE:
            v = _round_to(v.to(tl.float32), CACHE_DTYPE, INTERP)
        vc = (vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch
              + offs_f[None, :] * stride_vcd)
        tl.store(vc, v, mask=vmask)


def rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """`rotary` then `kv_store.store_kv` of the rotated k and of v, in one launch: returns
    the rotated q; k and v go only to their cache slots (a decode step is a chain of
    small launches, so one fewer per layer is time saved). Caches in q's dtype or in
    float8 e4m3 (values rounded as `store_kv` rounds them), of any strides with a unit
    stride over K's head_dim (a float8 PagePool's V is token-major).
    qk_norm: (q weight, k weight, eps, offset): each q and k head RMS-normalized first
    (kernels.reference.rms_norm over head_dim), two launches fewer per layer."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape == v.shape == (t, kvh, d) and d % 2 == 0 and k.dtype == q.dtype == v.dtype
    assert k_cache.shape[-2:] == (kvh, d) and v_cache.shape == k_cache.shape
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert k_cache.stride(-1) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    half = d // 2
    qn, kn, eps, offset = qk_norm if qk_norm is not None else (q, q, 0.0, 0.0)
    assert qk_norm is None or qn.shape == kn.shape == (d,)
    if t > 0:
        pdl = _pdl_enabled(q)
        _rotary_store_kernel[(t, 3)](
            q, k, v, q_out, k_cache, v_cache, positions.reshape(-1), slot_mapping, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            cos_sin.stride(0),
            qn,
            kn,
            float(eps),
            H=h,
            KVH=kvh,
            HALF=half,
            PAGE_SIZE=k_cache.shape[1],
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_KVH=triton.next_power_of_2(kvh),
            BLOCK_HALF=triton.next_power_of_2(half),
            DTYPE=_TL_DTYPES[q.dtype],
            CACHE_DTYPE=_TL_DTYPES[k_cache.dtype],
            INTERP=_interpreting(),
            PDL=pdl,
            NORM=qk_norm is not None,
            NORM_OFFSET=float(offset),
            num_warps=4,
            launch_pdl=pdl,
        )
    return q_out
