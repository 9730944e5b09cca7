"""Per-row float8 quantization of activations (quantization "fp8"): the Triton kernel
writes the bits of the torch reference, float8 rows and fp32 scales alike.

The RMSNorm before a float8 layer makes the same rows in its own launch. Interpreted on CPU,
compiled on CUDA (see tests/kernels/device.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import norm, quant, reference
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


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
@pytest.mark.parametrize("dtype,offset", [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.bfloat16, 1.0)],
                         ids=["fp32", "bf16", "bf16-gemma"])
def test_the_norm_before_a_float8_layer_makes_the_rows_of_its_own_output(residual, dtype, offset):
    """rms_norm_fp8: the norm's outputs are those of the plain norm kernel, bit for bit, and its
    float8 rows and scales are the reference's quantization of that output (what the float8
    layer after it would have made in a kernel of its own)."""
    gen = torch.Generator().manual_seed(3)
    hidden = 96  # (not a power of two: masked lanes must not reach the row's max)
    x = (torch.randn(7, hidden, generator=gen) * torch.logspace(-2, 2, 7)[:, None]).to(dtype).to(DEVICE)
    res = torch.randn(7, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    w = (0.5 + torch.rand(hidden, generator=gen)).to(dtype).to(DEVICE)
    out, new_res, (q, scale) = norm.rms_norm_fp8(x, res, w, 1e-6, offset)
    if residual:
        plain, plain_res = norm.fused_add_rms_norm(x, res, w, 1e-6, offset=offset)
        assert torch.equal(new_res, plain_res)
    else:
        plain = norm.rms_norm(x, w, 1e-6, offset=offset)
        assert new_res is None
    assert torch.equal(out, plain)
    q_ref, scale_ref = reference.quantize_rows_fp8(out.cpu())
    assert q.shape == (7, hidden) and scale.shape == (7, 1)
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_only_live_rows_are_quantized():
    """live = (ids, pairs, div): row r is quantized when ids[r // div] < pairs (kernels/moe.py's
    padded intermediate; its readers mask the other rows off), to the reference's bits."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 32, generator=gen)
    x[2] = float("nan")  # a padding row may hold anything: it is never read
    ids = torch.tensor([0, 9, 3, 9], dtype=torch.int32)  # pairs 9: entries 1 and 3 are padding
    q, scale = quant.quantize_rows_fp8(x.to(DEVICE), (ids.to(DEVICE), 9, 2))  # two rows per id
    q_ref, scale_ref = reference.quantize_rows_fp8(x)
    for r in (0, 1, 4, 5):
        assert torch.equal(q[r].cpu().view(torch.uint8), q_ref[r].view(torch.uint8)) and scale[r].item() == scale_ref[r]


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_activation_before_a_float8_layer_makes_the_rows_of_its_product(gelu, dtype):
    """gated_fp8: the gated activation's product, bit for bit that of the plain kernel (here one
    program per row), and its float8 rows and scales, the reference's quantization of it."""
    from kernels import activation

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 2 * 200, generator=gen) * 3).to(dtype).to(DEVICE)  # (I = 200: masked lanes)
    h, (q, scale) = activation.gated_fp8(x, gelu)
    plain = activation.gelu_tanh_and_mul(x) if gelu else activation.silu_and_mul(x)
    assert torch.equal(h, plain)
    q_ref, scale_ref = reference.quantize_rows_fp8(h.cpu())
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
