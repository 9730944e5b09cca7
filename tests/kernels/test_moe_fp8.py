"""Float8 experts (issue 30, `--quantization fp8`): the grouped GEMM (kernels/moe.py) and the
few-token GEMV (kernels/moe_gemv.py) on float8 weights with per-row scales equal
kernels.reference_moe.fused_moe's float8 formula, and that formula stays close to the bf16 MoE.

Tolerance: both sides quantize x with the same function (the same bits) and multiply exact
float8 products; only the float32 summation order differs. That moves an intermediate by an
ulp of x's dtype, and where it straddles a float8 rounding boundary of the activation's
quantization one element moves by a float8 step (1/16 relative): 3% of the output's scale
bounds the few such elements; most outputs agree far closer (the median check).
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe as M
from kernels import moe_gemv as G
from kernels import reference as R
from kernels import reference_moe as RM
from tests.kernels.device import DEVICE, cuda
from tests.kernels.test_moe import _problem


def fp8_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor):
    """Each expert's rows quantized as Linear.quantize_fp8 does: (q, scale [E, rows])."""
    out = []
    for w in (w_gate_up, w_down):
        e, n, k = w.shape
        q, s = R.quantize_rows_fp8(w.reshape(e * n, k))
        out += [q.view(e, n, k), s.view(e, n)]
    return out


def _check(fn, args, activation="silu", **kw):
    x, w_gu, w_d, weights, ids = args
    q_gu, s_gu, q_d, s_d = fp8_experts(w_gu, w_d)
    out = fn(x, q_gu, q_d, weights, ids, activation, w_gate_up_scale=s_gu, w_down_scale=s_d, **kw)
    ref = RM.fused_moe(x, q_gu, q_d, weights, ids, activation, w_gate_up_scale=s_gu, w_down_scale=s_d)
    assert out.dtype == ref.dtype == x.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item()
    assert err.max().item() <= 0.03 * scale
    assert err.median().item() <= 0.004 * scale
    return ref


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("t,e,k", [(19, 4, 2), (1, 16, 8)], ids=["e4k2", "one_token"])
def test_grouped_fp8_matches_reference(dtype, t, e, k):
    args = _problem(t, 80, 48, e, k, dtype, seed=t + e)
    _check(M.fused_moe, args, config=M.MoeConfig(block_m=16, block_n=16, block_k=16))


@DTYPES
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gemv_fp8_matches_reference(dtype, activation):
    args = _problem(3, 80, 48, 8, 2, dtype, seed=5)
    _check(G.moe_gemv, args, activation, block_n=8, block_k=16)


def test_fp8_formula_stays_close_to_bf16():
    """The float8 reference against the unquantized one: e4m3's 3 mantissa bits (1/16 per
    element) average out over the dot products to a few percent of the output."""
    x, w_gu, w_d, weights, ids = _problem(16, 128, 64, 8, 2, torch.float32, seed=2)
    q_gu, s_gu, q_d, s_d = fp8_experts(w_gu, w_d)
    fp8 = RM.fused_moe(x, q_gu, q_d, weights, ids, w_gate_up_scale=s_gu, w_down_scale=s_d)
    full = RM.fused_moe(x, w_gu, w_d, weights, ids)
    rel = (fp8 - full).norm() / full.norm()
    assert 1e-3 < rel.item() < 0.08  # quantized (not equal), and close


@cuda
@pytest.mark.parametrize("t", [1, 8, 300])
def test_fp8_model_sized(t):
    """Qwen3-30B-A3B's expert shape, compiled: the GEMV up to 16 tokens, the grouped GEMM on
    float8 tensor cores past it, through kernels.ops' dispatch."""
    from kernels import ops

    args = _problem(t, 2048, 768, 128, 8, torch.bfloat16, seed=t)
    _check(ops.fused_moe, args)
    assert DEVICE.type == "cuda"


@pytest.mark.parametrize("fn", [M.fused_moe, G.moe_gemv], ids=["grouped", "gemv"])
def test_rows_the_caller_made_are_taken_as_x(fn):
    """x_rows (the RMSNorm before the experts made them, kernels.ops.rms_norm_fp8): per-row
    float8 experts multiply those rows rather than quantizing x. x's own rows give the output
    bit for bit; rows of 2x double it, so they are the ones read."""
    x, w_gu, w_d, weights, ids = _problem(5, 80, 48, 8, 2, torch.float32, seed=6)
    q_gu, s_gu, q_d, s_d = fp8_experts(w_gu, w_d)
    kw = {"w_gate_up_scale": s_gu, "w_down_scale": s_d}
    kw.update({"config": M.MoeConfig(block_m=16, block_n=16, block_k=16)} if fn is M.fused_moe else
              {"block_n": 8, "block_k": 16})
    plain = fn(x, q_gu, q_d, weights, ids, **kw)
    # (the reference on the CPU: the kernels write its bits there, torch's CUDA ops need not)
    q, s = R.quantize_rows_fp8(x.cpu())
    assert torch.equal(fn(x, q_gu, q_d, weights, ids, x_rows=(q.to(DEVICE), s.to(DEVICE)), **kw), plain)
    doubled = RM.fused_moe(2 * x, q_gu, q_d, weights, ids, w_gate_up_scale=s_gu, w_down_scale=s_d)
    got = fn(x, q_gu, q_d, weights, ids, x_rows=(q.to(DEVICE), (2 * s).to(DEVICE)), **kw)
    err = (got - doubled).abs()
    assert err.max().item() <= 0.03 * doubled.abs().max().item()
