"""Per-row float8 quantization of activations (quantization "fp8"): the Triton kernel
writes the bits of the torch reference, float8 rows and fp32 scales alike.

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import quant, reference
from tests.kernels.device import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [40, 100, 1024])
def test_rows_quantize_to_the_references_bits(dtype, k):
    """Rows over seven decades of magnitude, an all-zero row, a row with one huge value (the
    rest falls into float8's subnormals), and values that sit on rounding ties."""
    gen = torch.Generator().manual_seed(k)
    rows = 12
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-4, 3, rows)[:, None]
    x[3] = 0.0
    x[5, 7] = 1e4
    x[6, :8] = torch.tensor([448.0, 0.5, -0.5625, 7.5, -7.9, 1.0625, 3.0, -448.0])  # ties of e4m3's grid
    x = x.to(dtype)
    q, scale = quant.quantize_rows_fp8(x.to(DEVICE))
    q_ref, scale_ref = reference.quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(q[3].cpu().float(), torch.zeros(k))  # a zero row stays zero


def test_a_strided_input_and_no_rows():
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))[:, :48]  # rows 64 apart
    q, scale = quant.quantize_rows_fp8(x.to(DEVICE))
    q_ref, scale_ref = reference.quantize_rows_fp8(x)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale.cpu(), scale_ref)
    q, scale = quant.quantize_rows_fp8(torch.zeros(0, 48, device=DEVICE))
    assert q.shape == (0, 48) and scale.shape == (0, 1)
