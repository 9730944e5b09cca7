"""The kernels Gemma adds: GeGLU (tanh GELU times up) and the RMSNorm with an offset
(x * (1 + w), in float32), each equal to its torch reference; and the references equal
transformers' own modules."""

from __future__ import annotations

import pytest
import torch

from kernels import activation, norm, reference
from tests.kernels.device import DEVICE

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _close(out, ref, tol):
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_tanh_and_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    # wide range: tanh saturates (|gate| ~ 12) and the cubic term dominates
    x = (torch.randn(5, 2 * 100, generator=gen) * 4).to(dtype).to(DEVICE)
    out = activation.gelu_tanh_and_mul(x)
    ref = reference.gelu_tanh_and_mul(x)
    assert out.shape == ref.shape == (5, 100) and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    _close(out, ref, TOL[dtype])


def test_gelu_tanh_reference_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    gate, up = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1))
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(reference.gelu_tanh_and_mul(torch.cat((gate, up), -1)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offset_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 96, generator=gen) * 3).to(dtype).to(DEVICE)
    res = torch.randn(6, 96, generator=gen).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(96, generator=gen)).to(dtype).to(DEVICE)
    out = norm.rms_norm(x, w, 1e-6, offset=1.0)
    ref = reference.rms_norm(x, w, 1e-6, offset=1.0)
    assert out.dtype == ref.dtype == dtype
    _close(out, ref, TOL[dtype])
    out, new_res = norm.fused_add_rms_norm(x, res, w, 1e-6, offset=1.0)
    ref, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-6, offset=1.0)
    assert torch.equal(new_res, ref_res)
    _close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offset_rms_norm_reference_is_transformers_gemma_rmsnorm(dtype):
    """Bit for bit, also in bf16: 1 + w is formed in float32 (a bf16 1 + w would round)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(3)
    hf = Gemma2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(0.01 * torch.randn(64, generator=gen))
    hf = hf.to(dtype)
    x = (torch.randn(4, 64, generator=gen) * 2).to(dtype)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, hf.weight, 1e-6, offset=1.0), hf(x))
