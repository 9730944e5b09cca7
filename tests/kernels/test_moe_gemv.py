"""kernels.moe_gemv (issue 30's decode path): moe_gemv == kernels.reference_moe.fused_moe for a
few tokens, and kernels.moe_route's route_topk, route and norm_route == kernels.reference_moe.route_topk
(norm_route after the reference's add + RMSNorm).

Tolerances as tests/kernels/test_moe.py: float32 differs by summation order only; in bf16
both round every stage to bf16, so an intermediate may differ by one ulp (2^-6 on outputs
of order 1). On CPU (interpreter) both sum the same bf16 products in float32 in another
order: nearly every bf16 output is bit-equal (<= 2% may differ by an ulp).
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe_gemv as G
from kernels import moe_route as MR
from kernels import reference_moe as RM
from tests.kernels.device import DEVICE, cuda
from tests.kernels.test_moe import _problem, assert_like_reference

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _check(args, activation="silu", **tiles):
    out = G.moe_gemv(*args, activation=activation, **tiles)
    assert_like_reference(out, RM.fused_moe(*args, activation=activation))


@DTYPES
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    "t,e,k", [(1, 16, 8), (3, 4, 2), (8, 128, 8), (2, 4, 1), (2, 16, 6)], ids=["one", "e4k2", "e128k8", "k1", "k6"]
)
def test_moe_gemv_matches_reference(dtype, activation, t, e, k):
    """H 40 and I 24 against 16-wide chunks and 8-row blocks: ragged K chunks and N blocks."""
    args = _problem(t, 40, 24, e, k, dtype, seed=t * e + k)
    _check(args, activation, block_n=8, block_k=16)


@DTYPES
def test_two_slots_on_one_expert_and_idle_experts(dtype):
    """Tokens sharing an expert each stream its rows; experts 1 and 2 get no token."""
    args = _problem(5, 48, 32, 4, 2, dtype, seed=3, experts_used=[0, 3])
    _check(args, "silu", block_n=16, block_k=16)


def test_default_tiles_and_dispatch():
    """The default tiles (one K chunk wider than H) and kernels.ops' choice by token count."""
    args = _problem(2, 64, 32, 8, 2, torch.float32, seed=1)
    _check(args)
    assert G.use_gemv(1) and G.use_gemv(G.MAX_TOKENS) and not G.use_gemv(G.MAX_TOKENS + 1) and not G.use_gemv(0)


def test_no_tokens():
    x, w_gu, w_d, weights, ids = _problem(1, 40, 24, 4, 2, torch.float32, seed=1)
    assert G.moe_gemv(x[:0], w_gu, w_d, weights[:0], ids[:0]).shape == (0, 40)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("round_to", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8), (4, 1)])
def test_route_topk_matches_reference(renormalize, round_to, e, k):
    """Softmax, top-k and renormalization in one kernel; E need not be a power of two."""
    gen = torch.Generator().manual_seed(e * k)
    logits = (torch.randn(7, e, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    w, ids = MR.route_topk(logits, k, renormalize, round_to)
    rw, rids = RM.route_topk(logits, k, renormalize, round_to)
    assert ids.dtype == rids.dtype == torch.int32 and w.dtype == rw.dtype == torch.float32
    tol = 1e-6 if round_to is None else 2**-8
    _same_routing(w, ids, rw, rids, tol)
    if renormalize and round_to is None:
        torch.testing.assert_close(w.sum(-1), torch.ones(7, device=DEVICE), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,h,e,k", [(1, 40, 8, 2), (5, 300, 60, 4), (3, 64, 128, 8), (16, 24, 4, 1)])
def test_route_is_the_router_linear_then_route_topk(dtype, t, h, e, k):
    """The fused router (GEMV + top-k by the last program of each token) equals F.linear in
    x's dtype followed by route_topk; called again it routes the same (its counts reset)."""
    gen = torch.Generator().manual_seed(t * e)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(e, h, generator=gen).to(dtype).to(DEVICE)
    rw, rids = RM.route_topk(torch.nn.functional.linear(x, w), k, True, dtype)
    for _ in range(2):
        got_w, got_ids = MR.route(x, w, k, True, dtype)
        _same_routing(got_w, got_ids, rw, rids, 1e-6 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,h,e,k", [(1, 40, 8, 2), (2, 64, 128, 8), (2, 4100, 8, 2)])
def test_norm_route_is_the_add_and_norm_then_the_router(dtype, t, h, e, k):
    """norm_route (the post-attention add + RMSNorm inside the router's kernel, each program
    normalizing the row; over 2,048 columns in chunks) equals fused_add_rms_norm then route: the
    same sum, the normalized rows within an ulp (the row statistic sums in another order), the
    same routing; called again, the same (its counts reset)."""
    from kernels import reference

    gen = torch.Generator().manual_seed(t * h)
    x, res = (torch.randn(t, h, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(DEVICE)
    w = torch.randn(e, h, generator=gen).to(dtype).to(DEVICE)
    normed, summed = reference.fused_add_rms_norm(x, res, nw, 1e-6)
    rw, rids = RM.route_topk(torch.nn.functional.linear(normed, w), k, True, dtype)
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    for _ in range(2):
        got_w, got_ids, got_normed, got_sum = MR.norm_route(x, res, nw, 1e-6, w, k, True, dtype)
        assert torch.equal(got_sum, summed)
        torch.testing.assert_close(got_normed, normed, atol=ulp * 4, rtol=ulp)
        _same_routing(got_w, got_ids, rw, rids, 1e-5 if dtype == torch.float32 else 2**-6)


@pytest.mark.parametrize("t,h", [(3, 64), (2, 4100)], ids=["one_load", "chunked"])
def test_norm_route_makes_the_float8_rows_of_what_it_normalizes(t, h):
    """norm_route_fp8: norm_route's outputs, bit for bit, and the float8 rows and scales of the
    normalized rows (the reference's quantization of them): in the router's kernel where a row
    fits one load, by a quantization after it past ROUTER_K columns."""
    from kernels import reference

    gen = torch.Generator().manual_seed(h)
    x, res = (torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(h, generator=gen)).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(8, h, generator=gen).to(torch.bfloat16).to(DEVICE)
    plain = MR.norm_route(x, res, nw, 1e-6, w, 2, True, torch.bfloat16)
    *got, (q, scale) = MR.norm_route_fp8(x, res, nw, 1e-6, w, 2, True, torch.bfloat16)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    q_ref, scale_ref = reference.quantize_rows_fp8(got[2].cpu())
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def _same_routing(w, ids, rw, rids, tol):
    """The same experts with the same weights; the order of slots of equal probability
    (bf16 logits tie often) may differ, which only reorders the weighted sum."""
    order, rorder = ids.long().sort(-1).indices, rids.long().sort(-1).indices
    assert torch.equal(ids.gather(-1, order).cpu(), rids.gather(-1, rorder).cpu())
    torch.testing.assert_close(w.gather(-1, order), rw.gather(-1, rorder), atol=tol, rtol=tol)


def test_route_topk_ties_take_the_lower_expert():
    logits = torch.zeros(1, 6, device=DEVICE)
    logits[0, 4] = logits[0, 2] = 1.0
    w, ids = MR.route_topk(logits, 3, True)
    assert ids.tolist() == [[2, 4, 0]]


@pytest.mark.parametrize("e", [4, 6])
def test_route_topk_gives_real_experts_for_non_finite_logits(e):
    """Rows of NaN, +inf or -inf logits still route to k distinct experts in [0, E): an id past
    the experts would make the grouped GEMM's index ops assert on the device, ending the process
    for every request. Finite rows beside them route as the reference does."""
    logits = torch.randn(5, e, generator=torch.Generator().manual_seed(e)).to(DEVICE)
    logits[1] = float("nan")
    logits[2, 1] = float("inf")
    logits[3] = float("-inf")
    logits[4, 0] = float("nan")
    w, ids = MR.route_topk(logits, 2, True)
    assert ((ids >= 0) & (ids < e)).all()
    assert (ids[:, 0] != ids[:, 1]).all()
    rw, rids = RM.route_topk(logits[:1], 2, True)
    _same_routing(w[:1], ids[:1], rw, rids, 1e-6)


@cuda
@pytest.mark.parametrize("t", [1, 4, 8])
def test_moe_gemv_model_sized(t):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 experts, top-8), compiled."""
    args = _problem(t, 2048, 768, 128, 8, torch.bfloat16, seed=t)
    _check(args)
    logits = torch.randn(t, 128, device=DEVICE).to(torch.bfloat16)
    w, ids = MR.route_topk(logits, 8, True, torch.bfloat16)
    rw, rids = RM.route_topk(logits, 8, True, torch.bfloat16)
    _same_routing(w, ids, rw, rids, 2**-8)
