"""Triton gated activations: x [..., 2I] = [gate | up] -> act(gate) * up, with act SiLU
(SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).

Like the reference (torch ops in x.dtype), act(gate) is rounded to x.dtype
before the multiply. One launch, no host synchronisation (CUDA-graph safe). For a float8
layer next (`gated_fp8`), one program per row also writes the product's float8 rows.

Also the MoE kernels' epilogue (`moe_glu`), which adds gpt-oss's clamped SwiGLU (`swigluoai`;
no dense op: gpt-oss has no dense MLP).
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
def gate_activation(g, GELU: tl.constexpr):
    """silu(g), or gelu(g, approximate="tanh") with GELU, in float32 (also the MoE kernel's)."""
    if GELU:
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (exp(2y) + 1);
        # |y| <= 15 keeps exp finite, and tanh(15) is 1 in float32 anyway
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        y = tl.minimum(tl.maximum(y, -15.0), 15.0)
        return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def swigluoai(g, up, ALPHA: tl.constexpr, LIMIT: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """gpt-oss's clamped SwiGLU of fp32 g, up (holding DTYPE values), in DTYPE:
    (clamp(up, -LIMIT, LIMIT) + 1) * gc * sigmoid(ALPHA * gc), gc = min(g, LIMIT), rounded to
    DTYPE after each step as kernels.reference.swigluoai_and_mul's torch ops in DTYPE round
    (ALPHA multiplied in float32, as torch does a Python scalar)."""
    # (a limit that DTYPE cannot hold: torch's clamp stores it rounded)
    g = _round_to(tl.minimum(g, LIMIT), DTYPE, INTERP).to(tl.float32)
    up = _round_to(tl.minimum(tl.maximum(up, -LIMIT), LIMIT), DTYPE, INTERP).to(tl.float32)
    z = _round_to(g * ALPHA, DTYPE, INTERP).to(tl.float32)
    sig = _round_to(1.0 / (1.0 + tl.exp(-z)), DTYPE, INTERP).to(tl.float32)
    glu = _round_to(g * sig, DTYPE, INTERP).to(tl.float32)
    return _round_to((_round_to(up + 1.0, DTYPE, INTERP).to(tl.float32)) * glu, DTYPE, INTERP)


@triton.jit
def moe_glu(
    g,
    up,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The MoE kernels' epilogue: fp32 gate and up products g, up (holding DTYPE values) ->
    act(g) * up in DTYPE for ACT "silu" or "gelu_tanh" (act(g) rounded to DTYPE before the
    multiply, as the reference), or gpt-oss's `swigluoai` (ALPHA, LIMIT)."""
    if ACT == "swigluoai":
        return swigluoai(g, up, ALPHA, LIMIT, DTYPE, INTERP)
    s = _round_to(gate_activation(g, ACT == "gelu_tanh"), DTYPE, INTERP).to(tl.float32)
    return _round_to(s * up, DTYPE, INTERP)


@triton.jit
def _gated_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    GELU: tl.constexpr = False,
    q_ptr=None,
    scale_ptr=None,
    QUANT: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0,
    TINY: tl.constexpr = 1e-12,
):
    """QUANT: BLOCK covers the row (one program per row), whose float8 rows and scale are
    stored too (kernels/quant.py quantize_row of the stored product)."""
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    s = _round_to(gate_activation(g, GELU), DTYPE, INTERP).to(tl.float32)
    out = _round_to(s * u, DTYPE, INTERP)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if QUANT:
        quantize_row(out.to(tl.float32), q_ptr + row * INTER + offs, mask, scale_ptr + row, FMAX, TINY, INTERP)


def silu_and_mul(x: torch.Tensor, block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x: [..., 2I] holding gate then up -> silu(gate) * up, [..., I]. block: elements of a
    row per program (default: up to 1,024); block and num_warps are for tuning."""
    return _gated(x, block, num_warps, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor, block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x: [..., 2I] holding gate then up -> gelu(gate, approximate="tanh") * up, [..., I]."""
    return _gated(x, block, num_warps, gelu=True)


def gated_fp8(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """silu_and_mul (gelu: gelu_tanh_and_mul) and the product's float8 rows and scales
    (kernels.reference.quantize_rows_fp8 of it, the same bits) in one launch, for a float8
    layer per token next: (product [..., I], (float8 [rows, I], fp32 scales [rows, 1]))."""
    return _gated(x, None, 4, gelu, fp8=True)


def _gated(x: torch.Tensor, block: int | None, num_warps: int, gelu: bool, fp8: bool = False):
    two_i = x.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    quant = None
    if fp8:  # one program per row: its max needs the whole row
        quant = empty_rows(rows, inter, x.device)
        block = triton.next_power_of_2(inter)
        num_warps = max(4, min(16, block // 1024))
    if block is None:
        block = min(1024, triton.next_power_of_2(inter))
    if rows > 0:
        pdl = _pdl_enabled(x)
        _gated_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            INTER=inter,
            BLOCK=block,
            DTYPE=_TL_DTYPES[x.dtype],
            INTERP=_interpreting(),
            PDL=pdl,
            GELU=gelu,
            q_ptr=out if quant is None else quant[0],
            scale_ptr=out if quant is None else quant[1],
            QUANT=fp8,
            FMAX=FP8_MAX,
            TINY=FP8_TINY,
            num_warps=num_warps,
            launch_pdl=pdl,
        )
    out = out.view(*x.shape[:-1], inter)
    return out if quant is None else (out, quant)
