"""Triton per-row float8 quantization of activations (quantization "fp8", streamer/model/quant.py).

One program per row: it reads the row once, takes its max |x|, and writes the float8 row
and its scale; the torch version (kernels.reference.quantize_rows_fp8) is five passes over
the row, one of them writing it in fp32. Same bits as the reference: the scale and its
reciprocal are the same fp32 divisions (rounded to nearest, as torch's), and the cast rounds
to nearest even after clamping to +-448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import interpreting as _interpreting
from kernels.common import pdl_enabled as _pdl_enabled
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to
from kernels.reference import FP8_MAX, FP8_TINY


def empty_rows(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for m rows of k float8 values and their fp32 scales [m, 1] (what quantize_row writes)."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


@triton.jit
def quantize_row(x, q_ptrs, mask, scale_ptr, FMAX: tl.constexpr, TINY: tl.constexpr, INTERP: tl.constexpr):
    """Store one row x (fp32, zero where masked off) as float8 at q_ptrs and its scale at
    scale_ptr: kernels.reference.quantize_rows_fp8's bits (also the epilogue of kernels/norm.py's
    RMSNorm for a float8 layer's input)."""
    # div_rn: a compiled fp32 `/` is PTX div.full (approximate, ~2 ulp); torch divides exactly.
    # One division per row; the elements are multiplied by its reciprocal (a division per
    # element made the kernel ALU-bound: 232 us for 8192 x 14336, 3x its bytes' time)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FMAX), TINY)
    y = tl.minimum(tl.maximum(x * tl.math.div_rn(1.0, scale), -FMAX), FMAX)
    if INTERP:
        q = _round_to(y, tl.float8e4nv, INTERP)
    else:
        # one cvt.rn.satfinite per two values on sm_89+, the rounding of torch's cast
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(q_ptrs, q, mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    live_ptr,
    PAIRS,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FMAX: tl.constexpr,
    TINY: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    LIVE_DIV: tl.constexpr = 0,
):
    """One row per program; with LIVE_DIV, row r is skipped (nothing written) when
    live[r // LIVE_DIV] >= PAIRS: the padding rows of kernels/moe.py's sorted pairs."""
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if LIVE_DIV:
        if tl.load(live_ptr + row // LIVE_DIV) >= PAIRS:
            return
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    quantize_row(x, q_ptr + row * K + offs, mask, scale_ptr + row, FMAX, TINY, INTERP)


def quantize_rows_fp8(
    x: torch.Tensor, live: tuple[torch.Tensor, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32 / fp16 / bf16) -> (float8 e4m3 [M, K], fp32 scales [M, 1]).

    live = (ids, pairs, div): only rows r with ids[r // div] < pairs are quantized; the others'
    rows and scales are left unwritten (their reader masks them off). kernels/moe.py's
    intermediate: its padding rows (the sentinel pair) need neither zeros nor a quantization."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scale = empty_rows(m, k, x.device)
    if m == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    pdl = _pdl_enabled(x)
    ids, pairs, div = live if live is not None else (x, 0, 0)
    _quantize_rows_kernel[(m,)](
        x, q, scale, x.stride(0), ids, pairs,
        K=k,
        BLOCK=block,
        FMAX=FP8_MAX,
        TINY=FP8_TINY,
        INTERP=_interpreting(),
        PDL=pdl,
        LIVE_DIV=div,
        num_warps=max(1, min(16, block // 512)),
        launch_pdl=pdl,
    )  # fmt: skip
    return q, scale
