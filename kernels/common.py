"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True under TRITON_INTERPRET (numpy emulation, used for CPU tensors in the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp32 `x` rounded (nearest even) to DTYPE, returned as DTYPE.

    The interpreter truncates bf16 casts, so it rounds by hand there."""
    if INTERP and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
