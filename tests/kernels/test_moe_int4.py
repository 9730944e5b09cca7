"""Int4 experts (kernels/moe_int4.py) == kernels.reference_moe.fused_moe on the dequantized
experts: the grouped GEMMs dequantize each K tile (rounded to x's dtype, as the reference's
weights are) and keep kernels/moe.py's roundings, so outputs differ by summation order only."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_int4 as M4
from kernels import reference_moe as RM
from kernels.int4 import dequantize
from kernels.moe import MoeConfig
from tests.kernels.device import CUDA, DEVICE, cuda
from tests.kernels.test_moe import TOL, _problem, assert_like_reference


def int4_experts(w: torch.Tensor, group: int, gen: torch.Generator):
    """Random int4 experts of w's shape [E, N, K]: (qweight, scales like w's magnitude, zeros)."""
    e, n, k = w.shape
    q = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.int64)
    words = (q.view(e, n, k // 8, 8) << torch.arange(0, 32, 4)).sum(-1)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scales = (torch.rand(e, n, k // group, generator=gen) * 0.4 / k**0.5 + 0.01 / k**0.5).to(w.dtype)
    zeros = torch.randint(0, 17, (e, n, k // group), generator=gen, dtype=torch.uint8)  # (GPTQ v1's may reach 16)
    return tuple(a.to(DEVICE) for a in (qweight, scales, zeros))


def _case(t, h, i, e, k, dtype, groups, seed):
    x, w_gu, w_d, weights, ids = _problem(t, h, i, e, k, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    return x, int4_experts(w_gu.cpu(), groups[0], gen), int4_experts(w_d.cpu(), groups[1], gen), weights, ids


PATHS = {"grouped": {"config": MoeConfig(block_m=16, block_n=16, block_k=32)}, "gemv": {"gemv": (16, 4)}}
"""The two ways through fused_moe_int4: alignment and grouped GEMMs, or the few-token GEMVs."""


def _tokens(t: int, path: str) -> int:
    """The tokens a case runs on this path: the GEMVs are for a few tokens, and interpreted every
    token's programs run one after another in Python, so on CPU they take at most 6 (both sides of
    GEMV_TOKENS, 4; 40 tokens took 35 s), compiled all of them."""
    return t if CUDA or path != "gemv" else min(t, 6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,e,k,groups", [(19, 4, 2, (32, 32)), (1, 8, 3, (16, 16)), (40, 6, 2, (64, 64)),
                                          (7, 4, 2, (128, 64))], ids=["e4k2", "one_token", "g64", "per_row"])
def test_int4_experts_match_the_dequantized_reference(dtype, t, e, k, groups, path):
    """(per_row: one group per row of each projection, H and I columns: compressed-tensors' channel strategy.)"""
    x, gu, d, weights, ids = _case(_tokens(t, path), 128, 64, e, k, dtype, groups, seed=t + e)
    out = M4.fused_moe_int4(x, gu, d, groups, weights, ids, **PATHS[path])
    ref = M4.reference(x, gu, d, groups, weights, ids)
    assert_like_reference(out, ref)


def test_the_reference_is_the_bf16_moe_on_dequantized_weights():
    """reference: each expert's rows dequantized as kernels.int4.dequantize (one layout: rows along
    N, K packed 8 to a word) and the ordinary MoE on them: no other rounding in between."""
    x, gu, d, weights, ids = _case(5, 64, 32, 4, 2, torch.float32, (32, 16), seed=3)
    full = [torch.stack([dequantize(q[j], s[j], z[j], g, torch.float32) for j in range(4)])
            for (q, s, z), g in ((gu, 32), (d, 16))]
    want = RM.fused_moe(x, full[0], full[1], weights, ids)
    torch.testing.assert_close(M4.reference(x, gu, d, (32, 16), weights, ids), want, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_order_experts_gather_their_inputs_by_their_own_order(dtype, path):
    """Each expert's K stored in its own act order (GPTQ desc_act): the kernels gather x's and the
    intermediate's columns by the expert's perm; the reference puts W's columns back in place."""
    x, gu, d, weights, ids = _case(_tokens(19, path), 128, 64, 4, 2, dtype, (32, 32), seed=21)
    gen = torch.Generator().manual_seed(22)
    perms = tuple(torch.stack([torch.randperm(n, generator=gen) for _ in range(4)]).to(torch.int32).to(DEVICE)
                  for n in (128, 64))
    out = M4.fused_moe_int4(x, gu, d, (32, 32), weights, ids, perms=perms, **PATHS[path])
    ref = M4.reference(x, gu, d, (32, 32), weights, ids, perms=perms)
    assert_like_reference(out, ref)
    plain = M4.reference(x, gu, d, (32, 32), weights, ids)
    assert (ref.float() - plain.float()).abs().max() > 10 * TOL[dtype]  # (the order matters)
    # the reference's W, put back in input order: stored column k multiplies input column perm[k]
    q, s, z = (a[:1] for a in d)
    stored = dequantize(q[0], s[0], z[0], 32, torch.float32)
    h = torch.randn(3, 64, dtype=torch.float32).to(DEVICE)
    full = torch.empty_like(stored)
    full[:, perms[1][0].long()] = stored
    torch.testing.assert_close(h @ full.T, h[:, perms[1][0].long()] @ stored.T)


@pytest.mark.parametrize("path", PATHS)
def test_activations_and_biases_follow_the_reference(path):
    x, gu, d, weights, ids = _case(_tokens(9, path), 64, 32, 4, 2, torch.float32, (32, 32), seed=11)
    gen = torch.Generator().manual_seed(12)
    b_gu = (torch.randn(4, 64, generator=gen) * 0.1).to(DEVICE)
    b_d = (torch.randn(4, 64, generator=gen) * 0.1).to(DEVICE)
    for act in ("gelu_tanh", "swigluoai"):
        out = M4.fused_moe_int4(x, gu, d, (32, 32), weights, ids, act, w_gate_up_bias=b_gu, w_down_bias=b_d,
                                **PATHS[path])
        ref = M4.reference(x, gu, d, (32, 32), weights, ids, act, w_gate_up_bias=b_gu, w_down_bias=b_d)
        torch.testing.assert_close(out, ref, rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_no_tokens_and_bad_groups():
    x, gu, d, weights, ids = _case(3, 64, 32, 4, 2, torch.float32, (32, 32), seed=1)
    assert M4.fused_moe_int4(x[:0], gu, d, (32, 32), weights[:0], ids[:0]).shape == (0, 64)
    with pytest.raises(AssertionError):
        M4.fused_moe_int4(x, gu, d, (64, 32), weights, ids)  # (the scales' shapes say 32)


@cuda
@pytest.mark.parametrize("t", [1, 4, 5, 16, 300])  # (GEMV_TOKENS 4: both sides of it)
def test_int4_experts_model_sized(t):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 experts, top-8, group 128), compiled with
    the default tiles, through kernels.ops (up to GEMV_TOKENS tokens by the GEMVs)."""
    from kernels import ops

    x, gu, d, weights, ids = _case(t, 2048, 768, 128, 8, torch.bfloat16, (128, 128), seed=t)
    out = ops.fused_moe_int4(x, gu, d, (128, 128), weights, ids)
    assert_like_reference(out, M4.reference(x, gu, d, (128, 128), weights, ids))
