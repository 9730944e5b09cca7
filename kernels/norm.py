"""Triton RMSNorm and fused residual-add + RMSNorm.

Arithmetic follows `kernels.reference`: the row statistic is computed in
float32, the normalized value is rounded to x.dtype and only then multiplied by
the weight (rounded to the promoted dtype of weight and x). Each wrapper is a
single launch with no host synchronisation, so it can be captured in a CUDA
graph. Under TRITON_INTERPRET (CPU tensors) roundings to bfloat16 are done by
hand because the interpreter truncates fp32 -> bf16 casts. With an offset (Gemma:
x * (1 + w)) everything stays float32 and is rounded to x.dtype once, as transformers'
Gemma RMSNorm computes it.
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
from kernels.quant import empty_rows, quantize_row
from kernels.reference import FP8_MAX, FP8_TINY


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    X_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    OFFSET: tl.constexpr = 0.0,
    q_ptr=None,
    scale_ptr=None,
    QUANT: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0,
    TINY: tl.constexpr = 1e-12,
):
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        xs = _round_to(x + r, X_DTYPE, INTERP)
        tl.store(new_res_ptr + row * stride_nr + offs, xs, mask=mask)
        x = xs.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET != 0.0:
        y = (x * rstd) * (OFFSET + w)
    else:
        y = w * _round_to(x * rstd, X_DTYPE, INTERP).to(tl.float32)
    out = _round_to(y, OUT_DTYPE, INTERP)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if QUANT:  # the stored row's float8 rows and scale, for a float8 layer that takes it next
        quantize_row(out.to(tl.float32), q_ptr + row * N + offs, mask, scale_ptr + row, FMAX, TINY, INTERP)


def _launch(x, residual, weight, eps, num_warps=None, offset=0.0, fp8=False):
    hidden = x.shape[-1]
    assert weight.shape[-1] == hidden
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_res = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    else:
        r2, new_res = x2, out
    quant = None
    if fp8:
        quant = empty_rows(rows, hidden, x.device)
    weight = weight.contiguous()
    block = triton.next_power_of_2(hidden)
    if num_warps is None:
        num_warps = max(1, min(16, block // 256))
    if rows > 0:
        pdl = _pdl_enabled(x)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_res,
            float(eps),
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            N=hidden,
            BLOCK=block,
            HAS_RES=residual is not None,
            X_DTYPE=_TL_DTYPES[x.dtype],
            OUT_DTYPE=_TL_DTYPES[out_dtype],
            INTERP=_interpreting(),
            PDL=pdl,
            OFFSET=float(offset),
            q_ptr=out if quant is None else quant[0],
            scale_ptr=out if quant is None else quant[1],
            QUANT=fp8,
            FMAX=FP8_MAX,
            TINY=FP8_TINY,
            num_warps=num_warps,
            launch_pdl=pdl,
        )
    out = out.view(*x.shape[:-1], hidden)
    return out, None if residual is None else new_res.view(*x.shape[:-1], hidden), quant


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int | None = None, offset: float = 0.0
) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype); x [..., hidden]. num_warps: per
    row (default hidden / 256, at most 16; tuning). offset: see kernels.reference.rms_norm."""
    return _launch(x, None, weight, eps, num_warps, offset)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    num_warps: int | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors."""
    out, new_res, _ = _launch(x, residual, weight, eps, num_warps, offset)
    return out, new_res


def rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
    """rms_norm (residual None) or fused_add_rms_norm, and the output's float8 rows with their
    scales (kernels.reference.quantize_rows_fp8 of the output [rows, hidden], the same bits) from
    the same launch: (out, x + residual or None, (float8 [rows, hidden], fp32 scales [rows, 1]))."""
    out, new_res, quant = _launch(x, residual, weight, eps, None, offset, fp8=True)
    assert quant is not None
    return out, new_res, quant
