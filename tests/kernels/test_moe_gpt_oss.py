"""gpt-oss's experts: per-expert biases and the clamped SwiGLU ("swigluoai") in
kernels.reference_moe.fused_moe, the grouped GEMM (kernels/moe.py) and the few-token GEMV
(kernels/moe_gemv.py).

The reference is checked against transformers' GptOssExperts (its loop written out here on
its interleaved layout, and the module itself), in float32. The kernels are checked against
the reference with the tolerances of tests/kernels/test_moe.py (bf16 on CPU: nearly every
output bit-equal, so each added rounding point must sit where the reference's is) and of
tests/kernels/test_moe_fp8.py for float8 experts. x is scaled so that gate values above
the limit and up values beyond +-limit occur (the clamps change the result).
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe as M
from kernels import moe_gemv as G
from kernels import ops
from kernels import reference as R
from kernels import reference_moe as RM
from tests.kernels.device import DEVICE
from tests.kernels.test_moe import _problem, assert_like_reference
from tests.kernels.test_moe_fp8 import fp8_experts

LIMIT = R.SWIGLU_LIMIT
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SMALL = M.MoeConfig(block_m=16, block_n=16, block_k=16)


def _gpt_oss_problem(t, h, i, e, k, dtype, seed, experts_used=None, x_scale=4.0):
    """test_moe's problem with x scaled up (pre-activations past the limit) and biases
    b_gu [E, 2I] (gate biases, then up biases), b_d [E, H]."""
    x, w_gu, w_d, weights, ids = _problem(t, h, i, e, k, dtype, seed, experts_used)
    gen = torch.Generator().manual_seed(seed + 1)
    b_gu = (torch.randn(e, 2 * i, generator=gen) * 0.5).to(dtype).to(DEVICE)
    b_d = (torch.randn(e, h, generator=gen) * 0.5).to(dtype).to(DEVICE)
    return [(x.float() * x_scale).to(dtype), w_gu, w_d, weights, ids], b_gu, b_d


def _clamps_bite(args, b_gu, limit=LIMIT):
    """Some routed (token, slot) has gate > limit and some has |up| > limit."""
    x, w_gu, _, _, ids = (a.float() for a in args)
    gu = torch.einsum("th,tknh->tkn", x, w_gu[ids.long()]) + b_gu.float()[ids.long()]
    gate, up = gu.chunk(2, dim=-1)
    return bool((gate > limit).any()) and bool((up.abs() > limit).any())


def _gpt_oss_loop(x, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, weights, ids, alpha, limit):
    """transformers' GptOssExperts.forward (5.24), its interleaved layout: gate_up_proj
    [E, H, 2I] with gate and up columns alternating, down_proj [E, I, H]."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token_idx, top_k_pos = torch.where(ids == e)
        gate_up = x[token_idx] @ gate_up_proj[e] + gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        y = ((up + 1) * glu) @ down_proj[e] + down_proj_bias[e]
        out.index_add_(0, token_idx, y * weights[token_idx, top_k_pos, None])
    return out


def _interleaved(w_gu, b_gu, w_d, b_d):
    """Our layout [E, 2I, H] (gate rows, then up rows) back to transformers' interleaved one."""
    e, two_i, h = w_gu.shape
    i = two_i // 2
    gate_up = torch.stack([w_gu[:, :i], w_gu[:, i:]], dim=2).reshape(e, two_i, h).transpose(1, 2)
    bias = torch.stack([b_gu[:, :i], b_gu[:, i:]], dim=2).reshape(e, two_i)
    return gate_up.contiguous(), bias, w_d.transpose(1, 2).contiguous(), b_d


def _deinterleave(gate_up, bias):
    """What the gpt-oss loader does: [E, H, 2I] interleaved -> [E, 2I, H], gate rows first."""
    w = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    return w, torch.cat([bias[:, ::2], bias[:, 1::2]], dim=-1)


@pytest.mark.parametrize("alpha,limit", [(R.SWIGLU_ALPHA, LIMIT), (1.0, 3.0)], ids=["gpt_oss", "other"])
def test_reference_is_gpt_oss_experts(alpha, limit):
    """float32: the reference with biases and swigluoai against transformers' loop, on weights
    given in transformers' interleaved layout and de-interleaved as the loader does."""
    (x, w_gu, w_d, weights, ids), b_gu, b_d = _gpt_oss_problem(9, 40, 24, 6, 3, torch.float32, seed=4)
    x, w_gu, w_d, weights, ids, b_gu, b_d = (a.cpu() for a in (x, w_gu, w_d, weights, ids, b_gu, b_d))
    assert _clamps_bite([x, w_gu, w_d, weights, ids], b_gu, limit)
    gate_up, gate_up_bias, down, down_bias = _interleaved(w_gu, b_gu, w_d, b_d)
    ours, our_bias = _deinterleave(gate_up, gate_up_bias)
    assert torch.equal(ours, w_gu) and torch.equal(our_bias, b_gu)
    want = _gpt_oss_loop(x, gate_up, gate_up_bias, down, down_bias, weights, ids, alpha, limit)
    got = RM.fused_moe(
        x,
        ours,
        w_d,
        weights,
        ids,
        "swigluoai",
        w_gate_up_bias=our_bias,
        w_down_bias=b_d,
        swiglu_alpha=alpha,
        swiglu_limit=limit,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the module itself (its default gpt-oss alpha and limit)
    if (alpha, limit) == (R.SWIGLU_ALPHA, LIMIT):
        gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
        from transformers import GptOssConfig

        cfg = GptOssConfig(hidden_size=40, intermediate_size=24, num_local_experts=6, num_experts_per_tok=3)
        experts = gpt_oss.GptOssExperts(cfg)
        with torch.no_grad():
            for p, v in zip(
                (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias),
                (gate_up, gate_up_bias, down, down_bias),
            ):
                p.copy_(v)
            module = experts(x, ids.long(), weights)
        torch.testing.assert_close(got, module, atol=1e-5, rtol=1e-5)


def test_reference_without_biases_or_clamp_is_plain_swiglu():
    """swigluoai with a limit nobody reaches and alpha 1: (up + 1) * silu(gate); no biases
    passed equals zero biases (float32)."""
    x, w_gu, w_d, weights, ids = _problem(5, 40, 24, 4, 2, torch.float32, seed=2)
    got = RM.fused_moe(x, w_gu, w_d, weights, ids, "swigluoai", swiglu_alpha=1.0, swiglu_limit=1e9)
    plus_one = torch.zeros(4, 48, device=x.device)
    plus_one[:, 24:] = 1.0
    want = RM.fused_moe(x, w_gu, w_d, weights, ids, "silu", w_gate_up_bias=plus_one)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    zeros = RM.fused_moe(
        x,
        w_gu,
        w_d,
        weights,
        ids,
        "swigluoai",
        w_gate_up_bias=torch.zeros_like(plus_one),
        w_down_bias=torch.zeros(4, 40, device=x.device),
    )
    torch.testing.assert_close(zeros, RM.fused_moe(x, w_gu, w_d, weights, ids, "swigluoai"), atol=0, rtol=0)


KERNELS = pytest.mark.parametrize(
    "kernel",
    [
        lambda *a, **kw: M.fused_moe(*a, config=SMALL, **kw),
        lambda *a, **kw: G.moe_gemv(*a, block_n=8, block_k=16, **kw),
    ],
    ids=["grouped", "gemv"],
)
ACT_BIAS = pytest.mark.parametrize(
    "activation,bias",
    [("silu", True), ("swigluoai", True), ("swigluoai", False)],
    ids=["silu_b", "oai_b", "oai"],
)


def _check(kernel, args, b_gu, b_d, activation, bias, **kw):
    if bias:
        kw |= {"w_gate_up_bias": b_gu, "w_down_bias": b_d}
    out = kernel(*args, activation=activation, **kw)
    assert_like_reference(out, RM.fused_moe(*args, activation=activation, **kw))


@DTYPES
@KERNELS
@ACT_BIAS
@pytest.mark.parametrize(
    "t,e,k,used",
    [(1, 8, 4, None), (9, 4, 1, None), (6, 8, 4, [0, 2, 3, 6, 7])],
    ids=["one_token_k4", "k1", "k4_idle_experts"],
)
def test_kernels_match_reference(dtype, kernel, activation, bias, t, e, k, used):
    """H 40, I 24 against 16-wide tiles: ragged chunks; experts 1, 4, 5 idle in the last case."""
    args, b_gu, b_d = _gpt_oss_problem(t, 40, 24, e, k, dtype, seed=t * e + k, experts_used=used)
    if used is not None:
        assert not torch.isin(args[4], torch.tensor([1, 4, 5], device=DEVICE)).any()
    if t > 1:
        assert _clamps_bite(args, b_gu if bias else torch.zeros_like(b_gu))
    _check(kernel, args, b_gu, b_d, activation, bias)


@KERNELS
def test_kernels_pass_alpha_and_limit(kernel):
    """Non-default swiglu_alpha and swiglu_limit (a limit bf16 rounds: 2.3 -> 2.296875)."""
    args, b_gu, b_d = _gpt_oss_problem(5, 40, 24, 4, 2, torch.bfloat16, seed=8)
    _check(kernel, args, b_gu, b_d, "swigluoai", True, swiglu_alpha=1.3, swiglu_limit=2.3)


@pytest.mark.parametrize(
    "kernel",
    [
        lambda *a, **kw: M.fused_moe(*a, config=M.MoeConfig(block_m=16, block_n=16, block_k=32), **kw),
        lambda *a, **kw: G.moe_gemv(*a, block_n=8, block_k=16, **kw),
    ],
    ids=["grouped", "gemv"],
)
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_fp8_with_biases_matches_reference(kernel, activation):
    """Float8 experts with biases: each bias added after the scaled product is rounded
    (tolerance of tests/kernels/test_moe_fp8.py). block_k 32: a compiled float8 tl.dot needs
    K >= 32."""
    (x, w_gu, w_d, weights, ids), b_gu, b_d = _gpt_oss_problem(3, 80, 48, 8, 2, torch.bfloat16, seed=5)
    q_gu, s_gu, q_d, s_d = fp8_experts(w_gu, w_d)
    kw = {"w_gate_up_scale": s_gu, "w_down_scale": s_d, "w_gate_up_bias": b_gu, "w_down_bias": b_d}
    out = kernel(x, q_gu, q_d, weights, ids, activation=activation, **kw)
    ref = RM.fused_moe(x, q_gu, q_d, weights, ids, activation, **kw)
    err = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item()
    assert err.max().item() <= 0.03 * scale
    assert err.median().item() <= 0.004 * scale
    no_bias = RM.fused_moe(x, q_gu, q_d, weights, ids, activation, w_gate_up_scale=s_gu, w_down_scale=s_d)
    assert (ref.float() - no_bias.float()).abs().max().item() > 0.1  # (the biases count)


@pytest.mark.parametrize("t", [1, 20], ids=["gemv", "grouped"])
def test_ops_passes_biases_and_activation(t):
    """kernels.ops.fused_moe hands the new arguments to whichever implementation it picks (on
    CUDA: the GEMV up to 16 tokens, the grouped GEMM past it; on CPU the reference)."""
    args, b_gu, b_d = _gpt_oss_problem(t, 40, 24, 4, 2, torch.float32, seed=t)
    kw = {"w_gate_up_bias": b_gu, "w_down_bias": b_d, "swiglu_alpha": 1.5, "swiglu_limit": 5.0}
    out = ops.fused_moe(*args, "swigluoai", **kw)
    torch.testing.assert_close(out, RM.fused_moe(*args, "swigluoai", **kw), atol=1e-5, rtol=1e-5)
    plain = ops.fused_moe(*args, "swigluoai")
    assert (out - plain).abs().max().item() > 0.1


def test_bias_shape_is_checked():
    args, b_gu, b_d = _gpt_oss_problem(2, 40, 24, 4, 2, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="expert bias"):
        G.moe_gemv(*args, activation="swigluoai", w_gate_up_bias=b_gu[:, :24])
    with pytest.raises(AssertionError, match="expert bias"):
        M.fused_moe(*args, activation="swigluoai", w_down_bias=b_d[:2])
