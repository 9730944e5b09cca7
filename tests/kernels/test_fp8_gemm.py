"""The float8 GEMM for a few dozen rows (kernels/fp8_gemm.py): the scaled product of float8
rows and float8 weight rows, summed and rounded once, as torch._scaled_mm's row-wise GEMM computes
it. Interpreted on CPU (exact products), compiled on CUDA (see tests/kernels/device.py), where the
float8 tensor cores' own sums are approximate (`SUMS`)."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_gemm, reference
from tests.kernels.device import DEVICE, cuda


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    w = torch.randn(n, k, generator=gen) * k**-0.5
    q, sx = reference.quantize_rows_fp8(x)
    qw, sw = reference.quantize_rows_fp8(w)
    return q, sx, qw, sw.view(-1)


def _reference(q, sx, qw, sw, dtype):
    """The product of the float8 values in float64 (exact per term), scaled, rounded once."""
    return ((q.double() @ qw.double().t()) * sx.double() * sw.double()[None, :]).to(dtype)


SUMS = 2**-12 if DEVICE.type == "cuda" else 0.0
"""How far a compiled float8 sum may be off, relative to its products' absolute sum. Hopper's float8
tensor cores align the products of one instruction (32 along K) to the largest of them and keep about
14 bits: measured on an H100, |error| / (|q| . |w|) reached 3.0e-5 on 64-256 rows (the same with
tl.dot's max_num_imprecise_acc at 32: the loss is inside each instruction), 5e-8 on 17 rows (no wgmma
there); benchmarks/RESULTS.md, thirty-seventh session. The interpreter's products and sums are exact."""


def _assert_within(got, want, q, sx, qw, sw, dtype, sides=1):
    """|got - want| within the tensor cores' error (`SUMS` of |q| . |w|, scaled; once per side
    computed on them) plus one rounding to dtype (fp32: the order of the fp32 sums)."""
    scale = sx.double().cpu().reshape(-1, 1) * sw.double().cpu()[None, :]
    products = (q.double().abs().cpu() @ qw.double().abs().cpu().t()) * scale
    want = want.double().cpu()
    rounding = 2**-7 if dtype == torch.bfloat16 else 1e-5
    tol = sides * SUMS * products + rounding * want.abs() + 1e-6
    err = (got.double().cpu() - want).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), (worst, err.flatten()[worst].item(), tol.flatten()[worst].item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", [(2, 48, 256), (17, 160, 80), (64, 96, 384), (133, 48, 128)])
def test_the_scaled_float8_product_rounded_once(m, n, k, dtype):
    """Row counts on and off the 16-row blocks, K not a multiple of the 128-wide K chunk (its
    tail masked to zeros), columns past the last full block."""
    q, sx, qw, sw = _operands(m, n, k, seed=m + n)
    got = fp8_gemm.fp8_gemm(q.to(DEVICE), sx.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), dtype).cpu()
    want = _reference(q, sx, qw, sw, dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    _assert_within(got, want, q, sx, qw, sw, dtype)


def test_rows_scaled_as_one_tensor_and_no_rows():
    """act "tensor" gives every row one scale (an expanded [M, 1]); zero rows give an empty result."""
    q, sx, qw, sw = _operands(5, 32, 64, seed=1)
    one = torch.full((5, 1), 0.25)
    got = fp8_gemm.fp8_gemm(q.to(DEVICE), one.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), torch.float32).cpu()
    _assert_within(got, _reference(q, one, qw, sw, torch.float32), q, one, qw, sw, torch.float32)
    empty = fp8_gemm.fp8_gemm(
        q[:0].to(DEVICE), sx[:0].to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), torch.bfloat16
    )
    assert empty.shape == (0, 32)


def test_tiles_give_every_sm_a_program_where_they_can():
    """16 rows up to 16, else 64; 64 columns only where that already makes one program per SM;
    256-wide K chunks where 64-row programs are fewer than the SMs."""
    assert fp8_gemm.tiles(8, 5120, 132) == (16, 32, 128)  # 80 column blocks of 64 would not fill 132
    assert fp8_gemm.tiles(32, 5120, 132) == (64, 32, 128)  # 160 programs
    assert fp8_gemm.tiles(40, 2048, 132) == (64, 32, 256)  # 64 programs: twice the bytes in flight each
    assert fp8_gemm.tiles(64, 4096, 132) == (64, 32, 256)  # 128 programs
    assert fp8_gemm.tiles(133, 5120, 132) == (64, 64, 128)  # 3 x 80 programs
    assert fp8_gemm.tiles(133, 2048, 132) == (64, 32, 128)
    assert fp8_gemm.STAGES[256] == 3


def test_cublas_keeps_the_layers_its_tiles_fill():
    """CPU: never. On CUDA, 2 to 256 rows and fewer 128 x 128 tiles than SMs."""
    assert not fp8_gemm.use_triton(64, 2048, torch.device("cpu"))
    if DEVICE.type == "cuda":
        assert fp8_gemm.use_triton(133, 5120, DEVICE)
        assert not fp8_gemm.use_triton(1, 5120, DEVICE)  # one row: the float8 GEMV's
        assert not fp8_gemm.use_triton(257, 2048, DEVICE)
        assert not fp8_gemm.use_triton(128, 28672, DEVICE)  # 224 tiles


@cuda
@pytest.mark.parametrize("m", [8, 133, 256])
def test_model_sized_against_cublas(m):
    """Qwen3-30B-A3B's qkv shape, compiled: the float8 tensor cores against torch._scaled_mm, each
    within the tensor cores' error of the exact sum."""
    q, sx, qw, sw = _operands(m, 5120, 2048, seed=m)
    q, sx, qw, sw = q.to(DEVICE), sx.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE)
    got = fp8_gemm.fp8_gemm(q, sx, qw, sw, torch.bfloat16)
    want = torch._scaled_mm(q, qw.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=torch.bfloat16)
    _assert_within(got, want, q, sx, qw, sw, torch.bfloat16, sides=2)
