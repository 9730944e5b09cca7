"""Block-scaled float8 experts (issue 30, Qwen3-30B-A3B-FP8 style: one fp32 scale per [bn, bk]
block of each projection, inputs quantized per token and per group of bk columns): the
grouped GEMM (kernels/moe.py) and the few-token GEMV (kernels/moe_gemv.py) equal
kernels.reference_moe.fused_moe's block formula, and that formula is the dense block-scaled
linear layer's (streamer/model/quant.py block_fp8_linear) applied expert by expert.

The shapes cut the tiles and the blocks unevenly: H 80 and I 48 are multiples of neither the
32-wide tiles nor the blocks, so the last block row and column of each projection are short,
and with bn 32 the gate's block rows end inside the gate (the up's grid starts after them).
Tolerances as tests/kernels/test_moe_fp8.py: the same quantized operands on both sides, only
the float32 summation order differs (an intermediate an ulp apart may round to a
neighbouring float8 value of the activation).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import moe as M
from kernels import moe_gemv as G
from kernels import reference_moe as RM
from tests.kernels.device import DEVICE, cuda
from tests.kernels.test_moe import _problem
from tests.kernels.test_moe_fp8 import fp8_experts

FP8 = torch.float8_e4m3fn


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (float8 [E, N, K], scales [E, ceil(N / bn), ceil(K / bk)]): each block's
    max |w| / 448, as a block-scaled checkpoint stores it (W = q * s)."""
    bn, bk = block
    e, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    s = padded.abs().view(e, nb, bn, kb, bk).amax(dim=(2, 4)) / 448.0
    full = s.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    return (w.float() / full).clamp(-448, 448).to(FP8), s


def block_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, block: tuple[int, int]):
    """The experts as a checkpoint of per-projection blocks holds them: gate and up each its own
    grid, stacked (the gate's block rows, then the up's); down one grid."""
    inter = w_down.shape[2]
    (qg, sg), (qu, su) = block_quantize(w_gate_up[:, :inter], block), block_quantize(w_gate_up[:, inter:], block)
    qd, sd = block_quantize(w_down, block)
    return torch.cat([qg, qu], 1), torch.cat([sg, su], 1), qd, sd


def _check(fn, args, block, activation="silu", **kw):
    x, w_gu, w_d, weights, ids = args
    q_gu, s_gu, q_d, s_d = block_experts(w_gu, w_d, block)
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_d, block=block)
    out = fn(x, q_gu, q_d, weights, ids, activation, **scales, **kw)
    ref = RM.fused_moe(x, q_gu, q_d, weights, ids, activation, **scales)
    assert out.dtype == ref.dtype == x.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item()
    assert scale > 0
    assert err.max().item() <= 0.03 * scale
    assert err.median().item() <= 0.004 * scale
    return out, ref


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CASES = pytest.mark.parametrize("t,e,k,used", [(19, 4, 2, [0, 1, 3]), (1, 8, 1, None), (6, 4, 3, None)],
                                ids=["e4k2_expert2_empty", "one_token_top1", "top3"])
BLOCKS = pytest.mark.parametrize("block", [(32, 32), (16, 64)], ids=["b32x32", "b16x64"])


@DTYPES
@CASES
@BLOCKS
def test_grouped_block_fp8_matches_reference(dtype, t, e, k, used, block):
    """K tiles of 16 inside groups of 32 or 64 columns: several tiles per scale."""
    args = _problem(t, 80, 48, e, k, dtype, seed=t + e + k, experts_used=used)
    _check(M.fused_moe, args, block, config=M.MoeConfig(block_m=16, block_n=32, block_k=16))


@DTYPES
@BLOCKS
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gemv_block_fp8_matches_reference(dtype, block, activation):
    args = _problem(3, 80, 48, 8, 2, dtype, seed=5)
    _check(G.moe_gemv, args, block, activation, block_n=8, block_k=64, down=(4, 32, 2, 4))


def test_gemv_one_token_top1():
    args = _problem(1, 80, 48, 4, 1, torch.bfloat16, seed=9)
    _check(G.moe_gemv, args, (32, 32), block_n=2, block_k=16)


def test_a_tile_as_wide_as_the_group():
    """K tile = bk (one tile per group) and a tile wider than the group asked for (cut to it)."""
    args = _problem(10, 80, 48, 4, 2, torch.float32, seed=3)
    _check(M.fused_moe, args, (16, 32), config=M.MoeConfig(block_m=16, block_n=16, block_k=32))
    _check(M.fused_moe, args, (16, 32), config=M.MoeConfig(block_m=16, block_n=16, block_k=64))


def test_reference_is_the_dense_block_linear_per_expert():
    """One expert, top 1, weight 1: the reference's block path is block_fp8_linear (the dense
    block-scaled layer's CPU formula) for gate, up and down, with silu(gate) * up between. I 48
    with bn 32: the up rows' scales are the up's own grid (the rows after the gate's two)."""
    from streamer.model.quant import block_fp8_linear

    block = (32, 32)
    x, w_gu, w_d, _, _ = (a.cpu() for a in _problem(5, 80, 48, 1, 1, torch.float32, seed=7))
    q_gu, s_gu, q_d, s_d = block_experts(w_gu, w_d, block)
    ids, weights = torch.zeros(5, 1, dtype=torch.int32), torch.ones(5, 1)
    got = RM.fused_moe(x, q_gu, q_d, weights, ids, w_gate_up_scale=s_gu, w_down_scale=s_d, block=block)
    gate = block_fp8_linear(x, q_gu[0, :48], s_gu[0, :2], block, None)
    up = block_fp8_linear(x, q_gu[0, 48:], s_gu[0, 2:], block, None)
    want = block_fp8_linear(F.silu(gate) * up, q_d[0], s_d[0], block, None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    stacked_grid = block_quantize(w_gu, block)[1]  # the stacked rows' grid: other scales for the up rows
    assert stacked_grid.shape == s_gu[:, :3].shape and not torch.equal(stacked_grid, s_gu[:, :3])


def test_one_block_per_row_is_the_per_row_formula():
    """Blocks of one row by a whole row (bn 1, bk >= K): the block scales are per-row scales and
    the inputs' groups whole rows, so the block path computes the per-row float8 path."""
    x, w_gu, w_d, weights, ids = (a.cpu() for a in _problem(12, 80, 48, 4, 2, torch.float32, seed=4))
    q_gu, s_gu, q_d, s_d = fp8_experts(w_gu, w_d)
    rows = RM.fused_moe(x, q_gu, q_d, weights, ids, w_gate_up_scale=s_gu, w_down_scale=s_d)
    blocks = RM.fused_moe(x, q_gu, q_d, weights, ids, w_gate_up_scale=s_gu[..., None], w_down_scale=s_d[..., None],
                         block=(1, 128))
    err = (blocks - rows).abs()
    assert err.max() <= 0.03 * rows.abs().max() and err.median() <= 1e-5 * rows.abs().max()


def test_block_formula_stays_close_to_the_unquantized_moe():
    x, w_gu, w_d, weights, ids = (a.cpu() for a in _problem(16, 128, 64, 8, 2, torch.float32, seed=2))
    q_gu, s_gu, q_d, s_d = block_experts(w_gu, w_d, (32, 32))
    fp8 = RM.fused_moe(x, q_gu, q_d, weights, ids, w_gate_up_scale=s_gu, w_down_scale=s_d, block=(32, 32))
    full = RM.fused_moe(x, w_gu, w_d, weights, ids)
    rel = (fp8 - full).norm() / full.norm()
    assert 1e-3 < rel.item() < 0.08  # quantized (not equal), and close


@cuda
@pytest.mark.parametrize("t", [1, 8, 300])
def test_block_fp8_model_sized(t):
    """Qwen3-30B-A3B-FP8's expert shape and [128, 128] blocks, compiled, through kernels.ops'
    dispatch: the GEMV up to 16 tokens, the grouped GEMM on float8 tensor cores past it."""
    from kernels import ops

    args = _problem(t, 2048, 768, 128, 8, torch.bfloat16, seed=t)
    _check(ops.fused_moe, args, (128, 128))
    assert DEVICE.type == "cuda"
