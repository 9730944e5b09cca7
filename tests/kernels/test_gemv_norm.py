"""kernels.gemv.norm_gemv (the decode GEMV of rms_norm(x + residual), the norm in every
program's prologue) and gemv(keep_splits=True) (the split-K partials left for the next kernel).

The norm's operands and roundings are kernels/norm.py's, so the product is that of the norm's
output up to the order of fp32 sums (the row statistic is reduced over another layout); the
residual it stores is x + residual exactly. On CPU through the Triton interpreter with small
tiles (several chunks, splits and row blocks); compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv as G
from kernels import reference
from tests.kernels.device import DEVICE, cuda

TOL = {torch.float32: 1e-4, torch.bfloat16: 2**-6}
CONFIGS = {
    "default": None,
    "split3": G.GemvConfig(block_n=4, block_k=32, unroll=2, split_k=3),
    "acc1d_split2": G.GemvConfig(block_n=16, block_k=32, unroll=1, split_k=2, acc_1d=True),
}


def _rand(*shape, dtype, gen, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)


def _operands(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _rand(m, k, dtype=dtype, gen=gen)
    res = _rand(m, k, dtype=dtype, gen=gen, scale=3.0)
    nw = _rand(k, dtype=dtype, gen=gen, scale=0.1, shift=1.0)
    w = _rand(n, k, dtype=dtype, gen=gen, scale=k**-0.5)
    return x, res, nw, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
def test_norm_gemv_is_the_gemv_of_the_fused_add_norm(dtype, m, cfg):
    n, k = 37, 200  # neither a multiple of any block
    x, res, nw, w = _operands(m, n, k, dtype, seed=m)
    y, new_res = G.norm_gemv(x, res, nw, 1e-6, 0.0, w, config=CONFIGS[cfg])
    normed, ref_res = reference.fused_add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(new_res, ref_res)  # x + residual, rounded once, every element stored once
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), F.linear(normed, w).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_norm_gemv_without_residual_and_with_an_offset(offset):
    """residual None (a model's first layer): rms_norm(x) alone, nothing stored; offset 1:
    Gemma's x * (1 + w), in float32 and rounded once as kernels.reference.rms_norm."""
    x, _, nw, w = _operands(2, 24, 96, torch.bfloat16, seed=7)
    y, new_res = G.norm_gemv(x, None, nw - offset, 1e-5, offset, w, config=CONFIGS["split3"])
    assert new_res is None
    ref = F.linear(reference.rms_norm(x, nw - offset, 1e-5, offset), w)
    torch.testing.assert_close(y.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("m", [2, 5])
def test_per_row_norm_gemv_gives_each_row_the_bits_of_a_lone_row(m):
    """A verify step's rows equal the decode of each row alone, bit for bit (as gemv's per_row):
    the engine takes this path for both, so speculation stays exact."""
    x, res, nw, w = _operands(m, 40, 2048, torch.bfloat16, seed=m + 3)
    rows, rows_res = G.norm_gemv(x, res, nw, 1e-6, 0.0, w, per_row=True)
    for i in range(m):
        alone, alone_res = G.norm_gemv(x[i : i + 1], res[i : i + 1], nw, 1e-6, 0.0, w)
        assert torch.equal(rows[i], alone[0]) and torch.equal(rows_res[i], alone_res[0]), i


@pytest.mark.parametrize("m", [1, 3])
def test_kept_splits_sum_to_the_gemv(m):
    """keep_splits: the float32 partials [S, M, N] whose in-order sum, rounded, is gemv's output
    bit for bit (the reduction kernel's arithmetic); an unsplit shape returns the output itself."""
    cfg = CONFIGS["split3"]
    x, _, _, w = _operands(m, 37, 200, torch.bfloat16, seed=11)
    parts = G.gemv(x, w, cfg, keep_splits=True)
    assert parts.dtype == torch.float32 and parts.shape[0] > 1 and parts.shape[1:] == (m, 37)
    total = parts[0]
    for s in range(1, parts.shape[0]):
        total = total + parts[s]
    assert torch.equal(total.to(torch.bfloat16), G.gemv(x, w, cfg))
    unsplit = G.GemvConfig(block_n=4, block_k=32, unroll=2)
    assert torch.equal(G.gemv(x, w, unsplit, keep_splits=True), G.gemv(x, w, unsplit))
    assert G.splits(m, 2048, 4096, torch.device("cpu"), 2) == 2  # (the MoE shape's o projection)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n,k", [(5120, 2048), (6144, 4096)], ids=["qwen3_30b_a3b_qkv", "llama_8b_qkv"])
def test_cuda_norm_gemv_at_model_sizes(n, k):
    """The qkv shapes of the benchmarks' models, compiled: within bf16's rounding of the unfused
    norm and GEMV (kernels.norm, then gemv), and the residual exact."""
    from kernels import norm

    x, res, nw, w = _operands(1, n, k, torch.bfloat16, seed=n)
    y, new_res = G.norm_gemv(x, res, nw, 1e-6, 0.0, w)
    normed, ref_res = norm.fused_add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(y.float(), G.gemv(normed, w).float(), atol=2**-6, rtol=2**-6)
