"""kernels.moe_chain: the batch-1 MoE MLP's two GEMVs in one launch give moe_gemv's bits, for
any tiles, slot counts and token counts, and leave their counts zeroed for the next call."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_chain as C
from kernels import moe_gemv as G
from kernels import reference_moe as RM
from tests.kernels.device import cuda
from tests.kernels.test_moe import _problem, assert_like_reference

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("preload", [False, True], ids=["spin", "preload"])
@pytest.mark.parametrize("t,e,k", [(1, 16, 8), (3, 4, 2), (2, 16, 6)], ids=["one", "e4k2", "k6"])
def test_chain_is_moe_gemv_bit_for_bit(dtype, preload, t, e, k):
    """H 40, I 24 against 8-row blocks and 16-wide chunks: ragged chunks and blocks in both GEMVs."""
    args = _problem(t, 40, 24, e, k, dtype, seed=t * e + k)
    tiles = {"block_n": 8, "block_k": 16}
    out = C.moe_chain(*args, **tiles, down=(4, 16, 1), preload=preload)
    assert torch.equal(out, G.moe_gemv(*args, **tiles, down=(4, 16, 1, 4)))
    assert_like_reference(out, RM.fused_moe(*args))
    assert not C._syncs[out.device].any()  # every count back to zero


@pytest.mark.parametrize("activation", ["gelu_tanh", "swigluoai"])
def test_chain_with_biases_and_other_activations(activation):
    x, w_gu, w_d, weights, ids = _problem(2, 32, 16, 4, 2, torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(7)
    b_gu = torch.randn(4, 32, generator=gen).to(x)
    b_d = torch.randn(4, 32, generator=gen).to(x)
    kw = {"activation": activation, "w_gate_up_bias": b_gu, "w_down_bias": b_d, "block_n": 4, "block_k": 16}
    out = C.moe_chain(x, w_gu, w_d, weights, ids, **kw, down=(4, 16, 2))
    assert torch.equal(out, G.moe_gemv(x, w_gu, w_d, weights, ids, **kw, down=(4, 16, 2, 4)))


def test_chain_twice_in_a_row():
    """The second call draws its tickets from zero again (the last program reset them)."""
    args = _problem(1, 64, 32, 8, 2, torch.bfloat16, seed=2)
    first = C.moe_chain(*args, block_n=8, block_k=32, down=(8, 32, 1))
    assert torch.equal(C.moe_chain(*args, block_n=8, block_k=32, down=(8, 32, 1)), first)


@cuda
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("preload", [False, True], ids=["spin", "preload"])
def test_chain_model_sized(t, preload):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 experts, top-8), compiled, default tiles."""
    args = _problem(t, 2048, 768, 128, 8, torch.bfloat16, seed=t)
    ref = G.moe_gemv(*args, down=(*G.DOWN[:3], C.WARPS))  # (the down tiles' warps: the same sums)
    for _ in range(3):
        assert torch.equal(C.moe_chain(*args, preload=preload), ref)


@pytest.mark.parametrize("t,h,e,k", [(1, 40, 16, 8), (3, 48, 4, 2)], ids=["one", "three"])
def test_norm_route_chain_is_norm_route_then_moe_gemv(t, h, e, k):
    """The router's tiles in the same launch (ROUTE): the normalized rows, the new residual and
    the experts' output all bit for bit as norm_route then moe_gemv."""
    from kernels import moe_route as MR

    dtype = torch.bfloat16
    x, w_gu, w_d, _, _ = _problem(t, h, 24, e, k, dtype, seed=t + e)
    gen = torch.Generator().manual_seed(t)
    residual = torch.randn(t, h, generator=gen).to(x)
    norm_w = (1 + 0.1 * torch.randn(h, generator=gen)).to(x)
    router = (torch.randn(e, h, generator=gen) * h**-0.5).to(x)
    args = (x, residual, norm_w, 1e-6, router, k, True, dtype)
    weights, ids, normed, new_res = MR.norm_route(*args)
    ref = G.moe_gemv(normed, w_gu, w_d, weights, ids)
    for preload in (False, True):
        out, c_normed, c_res = C.norm_route_chain(*args, w_gu, w_d, preload=preload)
        assert torch.equal(c_normed, normed) and torch.equal(c_res, new_res)
        assert torch.equal(out, ref)
        assert not C._syncs[out.device].any()


@cuda
@pytest.mark.parametrize("t", [1, 4])
def test_norm_route_chain_model_sized(t):
    """Qwen3-30B-A3B's MoE block at decode (H 2048, I 768, 128 experts, top-8), compiled, three calls."""
    from kernels import moe_route as MR

    x, w_gu, w_d, _, _ = _problem(t, 2048, 768, 128, 8, torch.bfloat16, seed=t)
    residual, norm_w = torch.randn_like(x), (1 + 0.1 * torch.randn(2048, device=x.device)).to(x)
    router = (torch.randn(128, 2048, device=x.device) * 2048**-0.5).to(x)
    args = (x, residual, norm_w, 1e-6, router, 8, True, None)
    weights, ids, normed, new_res = MR.norm_route(*args)
    ref = G.moe_gemv(normed, w_gu, w_d, weights, ids, down=(*G.DOWN[:3], C.WARPS))
    for _ in range(3):
        out, c_normed, c_res = C.norm_route_chain(*args, w_gu, w_d)
        assert torch.equal(c_normed, normed) and torch.equal(c_res, new_res) and torch.equal(out, ref)
