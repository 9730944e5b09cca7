"""Helpers shared by the decode and extend kernels (package-private).

Device side: K/V rows read from pages (`_load_kv_subtiles` by both kernels over 16-token
sub-tiles; `_load_pages` and `_load_kv_block` per token, by the decode kernel; the extend
kernel inlines its own per-token loads) and `_cast_in` to the compute dtype. Scores:
`_softcap` (Gemma 2's soft-capping in the kernels' exp2 domain); `_add_sink` (gpt-oss's attention
sinks, folded into the final normalization). Host side: the dtype of the
tensor-core dots (`_paged_compute`) and the output tensor (`_output`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES as _TL_DTYPES
from kernels.common import interpreting as _interpreting
from kernels.common import round_to as _round_to

_LOG2E = 1.4426950408889634


@triton.jit
def _cast_in(x, IN_DTYPE: tl.constexpr, COMPUTE: tl.constexpr, INTERP: tl.constexpr):
    """Cast loaded K/V/Q to the compute dtype, rounding through IN_DTYPE (q.dtype) first
    when the cache holds another dtype, like the reference's `.to(q.dtype)`. float8 pages
    convert straight to the compute dtype: every float8 value is exact in bf16/fp16/fp32."""
    if x.dtype == tl.float8e4nv:
        return x.to(COMPUTE)
    if x.dtype != IN_DTYPE:
        x = _round_to(x.to(tl.float32), IN_DTYPE, INTERP)
    return x.to(COMPUTE)


@triton.jit
def _softcap(qk, SOFTCAP: tl.constexpr):
    """Soft-capped scores: s -> SOFTCAP * tanh(s / SOFTCAP) for scores held as qk = s * log2(e)
    (the kernels fold log2(e) into the scale for exp2), which is the same map in that domain:
    c * tanh(qk / c) with c = SOFTCAP * log2(e). tanh(y) = 1 - 2 / (e^(2y) + 1), with
    e^(2y) = 2^(2 qk / SOFTCAP): exp2 runs on the GPU and in the interpreter alike, and the form
    saturates to +-c, never NaN, at either infinity. Apply before masking (-inf would map to -c)."""
    C: tl.constexpr = SOFTCAP * 1.4426950408889634
    TWO_OVER: tl.constexpr = 2.0 / SOFTCAP
    return C * (1.0 - 2.0 / (tl.exp2(qk * TWO_OVER) + 1.0))


@triton.jit
def _add_sink(m_i, l_i, acc, sink):
    """(l_i, acc) of an online softmax (row maxima m_i, in the exp2 domain) with one more logit
    per row, `sink` (gpt-oss's attention sink: natural-log units, not scaled, so it is taken to
    the exp2 domain here), whose value vector is zero: it only adds its mass to the denominator.
    Both are rescaled to max(m_i, sink), so a sink far above the scores underflows the output
    to 0 rather than overflowing l_i. A row with no keys and a -inf sink keeps l_i = 0 (-inf -
    -inf would be NaN)."""
    sink = sink * 1.4426950408889634
    m = tl.maximum(m_i, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    alpha = tl.exp2(m_i - m)
    return l_i * alpha + tl.exp2(sink - m), acc * alpha[:, None]


@triton.jit
def _load_pages(pt_row, toks, t_mask, PAGE_SIZE: tl.constexpr):
    return tl.load(pt_row + toks // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)


@triton.jit
def _load_kv_block(
    k_ptr,
    v_ptr,
    page,
    toks,
    t_mask,
    kvh,
    offs_d,
    d_mask,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    PAGE_SIZE: tl.constexpr,
):
    """K and V rows of tokens `toks` held in pages `page`, zeros where masked."""
    in_page = (toks % PAGE_SIZE).to(tl.int64)
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
    v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _load_kv_subtiles(
    k_head,
    v_head,
    pt_row,
    n0,
    limit,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    stride_vd,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K and V [BLOCK_N, BLOCK_D] of tokens n0 .. n0 + BLOCK_N - 1 (n0 a multiple of 16; with
    MASKED, those at or past `limit` read as zeros), read as 16-token sub-tiles, each inside
    one page (PAGE_SIZE % 16 == 0): one page id and one base address per sub-tile, fixed
    offsets inside it. k_head/v_head point at the KV head's first element.

    Per-token page lookups and 64-bit addresses cost more than the bytes of float8 pages (a
    32-key decode block took ~1,400 instructions, ~600 this way with token-major V), and
    with token-major V they hide from the compiler that a sub-tile's tokens are adjacent."""
    SUB: tl.constexpr = 16
    t0 = n0 + tl.arange(0, BLOCK_N // SUB) * SUB
    offs_t = tl.arange(0, SUB)
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED:
        page = tl.load(pt_row + t0 // PAGE_SIZE, mask=t0 < limit, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row + t0 // PAGE_SIZE).to(tl.int64)
    row0 = (t0 % PAGE_SIZE).to(tl.int64)
    k_ptrs = (k_head + page * stride_kp + row0 * stride_ks)[:, None, None] + (
        offs_t[:, None] * stride_ks + offs_d[None, :]
    )[None, :, :]
    v_ptrs = (v_head + page * stride_vp + row0 * stride_vs)[:, None, None] + (
        offs_t[:, None] * stride_vs + offs_d[None, :] * stride_vd
    )[None, :, :]
    if MASKED:
        live = ((t0[:, None] + offs_t[None, :]) < limit)[:, :, None]
        k = tl.load(k_ptrs, mask=live, other=0.0)
        v = tl.load(v_ptrs, mask=live, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return tl.reshape(k, [BLOCK_N, BLOCK_D]), tl.reshape(v, [BLOCK_N, BLOCK_D])


def _compute_dtype(q: torch.Tensor):
    if _interpreting() or q.dtype == torch.float32:
        return tl.float32
    return _TL_DTYPES[q.dtype]


def _output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The attention output: `out` (checked) or a new tensor shaped and typed like q."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    return out


def _sinks_arg(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The tensor to pass as a kernel's sinks pointer: `sinks` (checked: float32 [H], one
    logit per query head, on q's device; no conversion, so nothing is copied inside a CUDA
    graph), or any tensor when there are none (HAS_SINKS False: never read)."""
    if sinks is None:
        return q
    assert sinks.shape == (q.shape[1],) and sinks.dtype == torch.float32 and sinks.stride(0) == 1
    assert sinks.device == q.device
    return sinks


def _paged_compute(q: torch.Tensor, k_cache: torch.Tensor):
    """float8 pages on the GPU are multiplied in fp16: e4m3 -> fp16 is one conversion
    instruction per two values on sm_89/90 (e4m3 -> bf16 goes through fp16 and fp32), and
    fp16 keeps 3 more bits of q and p than bf16. Every e4m3 value is exact in fp16; q, whose
    bf16 range is wider, is saturated at +-65504 first. (Not faster by itself for decode on
    the H200: the conversion was not what bound that kernel, see num_warps in paged_decode;
    extend over 8 prompts of 1,000 tokens: 370 against 431 us, profile_gpu.py attn-w3.)"""
    compute = _compute_dtype(q)
    if k_cache.dtype == torch.float8_e4m3fn and compute == tl.bfloat16:
        return tl.float16
    return compute
