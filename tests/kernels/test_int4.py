"""kernels/int4.py (W4A16 GEMM and GEMV) == its torch reference, and the reference == the
weights an independent packer (here) wrote: W[n, k] = (q - z) * s per group of G along K.

Without a GPU the kernels run on CPU tensors through the Triton interpreter on tiny shapes
(N not a multiple of the tiles, several rows, groups 32 and 64 = several K tiles, per-row
groups G = K); the `cuda`-marked tests add model-sized shapes in bf16. Tolerances: the
kernels dequantize W exactly as the reference does (fp32, one rounding to x's dtype) and
accumulate in fp32 in another order: fp32 differs by summation order, bf16 by an output ulp.
"""

from __future__ import annotations

import pytest
import torch

from kernels import int4
from tests.kernels.device import DEVICE, cuda

TOL = {torch.float32: 1e-4, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def pack_k(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> int32 [N, K / 8], value k in bits 4 (k % 8) of word k // 8 (written
    value by value, independently of the module's vectorized packing)."""
    n, k = q.shape
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for j in range(8):
        words |= q[:, j::8].to(torch.int64) << (4 * j)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the top nibble's high bit is int32's sign


def random_layer(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 17, (n, k // group), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.05 + 0.01).to(dtype)
    w = ((q - zeros.repeat_interleave(group, 1)).double() * scales.double().repeat_interleave(group, 1)).to(dtype)
    return pack_k(q), scales, zeros.to(torch.uint8), w


def test_reference_dequantizes_what_was_packed():
    qweight, scales, zeros, w = random_layer(24, 64, 16, torch.float32)
    torch.testing.assert_close(int4.dequantize(qweight, scales, zeros, 16, torch.float32), w, rtol=0, atol=0)


CASES = [  # (M, N, K, group)
    (1, 40, 64, 32), (3, 40, 64, 32), (1, 24, 128, 64), (5, 72, 128, 64), (20, 40, 64, 64), (2, 16, 96, 96),
]


@pytest.mark.parametrize("m,n,k,group", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernels_match_reference(m, n, k, group, dtype):
    qweight, scales, zeros, w = random_layer(n, k, group, dtype, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    dev = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    ref = int4.reference_linear(x.float(), qweight, scales.float(), zeros, group)
    tol = TOL[dtype] * max(1.0, ref.abs().max().item())
    for got in (int4.int4_gemm(*dev, group, block=(16, 16, 16)), int4.int4_gemm(*dev, group),
                int4.int4_gemv(*dev, group, block=(16, 16)), int4.int4_gemv(*dev, group)):
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float().cpu(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("n,k,group", [(40, 64, 32), (24, 128, 16), (72, 96, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_dequantize_weight_is_the_reference_bit_for_bit(n, k, group, dtype):
    qweight, scales, zeros, _ = random_layer(n, k, group, dtype, seed=n + k)
    dev = [t.to(DEVICE) for t in (qweight, scales, zeros)]
    want = int4.dequantize(*dev, group, dtype)
    assert torch.equal(int4.dequantize_weight(*dev, group, dtype), want)


def test_many_rows_multiply_the_dequantized_weight(monkeypatch):
    """From DEQUANT_ROWS rows `linear` is the reference's own arithmetic: W written out, then x @ W^T."""
    monkeypatch.setattr(int4, "DEQUANT_ROWS", 4)
    qweight, scales, zeros, _ = random_layer(40, 64, 32, torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    dev = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    assert torch.equal(int4.linear(*dev, 32), int4.reference_linear(*dev, 32))


def test_per_row_rows_equal_single_rows():
    """linear(per_row=True) computes a verify step's rows exactly as decode's single row."""
    qweight, scales, zeros, _ = random_layer(24, 64, 32, torch.float32)
    x = torch.randn(3, 64)
    dev = [t.to(DEVICE) for t in (qweight, scales, zeros)]
    rows = int4.linear(x.to(DEVICE), *dev, 32, per_row=True)
    for i in range(3):
        assert torch.equal(rows[i : i + 1], int4.linear(x[i : i + 1].to(DEVICE), *dev, 32))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 7, 16, 300, 1024])
@pytest.mark.parametrize("group", [32, 128])
def test_model_sized_bf16(m, group):
    n, k = 4096 + 64, 4096
    qweight, scales, zeros, _ = random_layer(n, k, group, torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    dev = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    ref = int4.reference_linear(dev[0].float(), dev[1], dev[2].float(), dev[3], group)
    tol = 2**-7 * ref.abs().max().item()
    torch.testing.assert_close(int4.linear(*dev, group).float(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(int4.int4_gemm(*dev, group).float(), ref, rtol=0, atol=tol)
    if m <= int4.GEMV_ROWS:
        torch.testing.assert_close(int4.int4_gemv(*dev, group).float(), ref, rtol=0, atol=tol)
