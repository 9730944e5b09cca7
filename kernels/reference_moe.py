"""Plain torch versions of the mixture-of-experts kernels: the experts' MLP over routed tokens
(fused_moe) and the routers (route_topk, route_grouped). As kernels/reference.py: the CPU
path of the engine and the oracle of the Triton kernels (kernels/moe.py, moe_gemv.py,
moe_route.py), in transformers' arithmetic order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import (
    MOE_ACTIVATIONS,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    expand_blocks,
    gelu_tanh_and_mul,
    quantize_groups_fp8,
    quantize_rows_fp8,
    silu_and_mul,
    swigluoai_and_mul,
)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A mixture-of-experts MLP over routed tokens.

    x: [T, H]; w_gate_up: [E, 2I, H] (each expert's gate rows, then its up rows);
    w_down: [E, H, I]; topk_weights: [T, k] float32 (already normalized as the model wants);
    topk_ids: [T, k] int. Returns [T, H] in x's dtype:
        out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e x[t]) * up_e x[t]),  e = topk_ids[t, j]
    Each expert's products are computed in x's dtype (as transformers' per-expert loops do),
    the weighted sum in float32.

    activation (MOE_ACTIVATIONS): "silu" (SwiGLU), "gelu_tanh" (GeGLU), or "swigluoai", gpt-oss's
    clamped SwiGLU with swiglu_alpha and swiglu_limit (swigluoai_and_mul: act(gate) * up above
    reads (up + 1) * act(gate) there).
    Biases (gpt-oss): w_gate_up_bias [E, 2I] (gate biases, then up biases), w_down_bias [E, H],
    each optional: the expert's bias is added to its product, both in x's dtype (the product
    rounded first, then the sum: transformers' `x @ W + b`), before the activation and before
    the routing weight.

    Float8 experts (the scales given): float8 e4m3 weights with one fp32 scale per output
    row ([E, 2I], [E, H]); each GEMM's input is quantized per row (x per token, the
    activation per (token, slot): quantize_rows_fp8) and its product is
    sa[m] * sw[n] * (q(a)[m] . q(W)[n]) in float32, rounded to x's dtype (quant.fp8_linear's formula).

    Block-scaled float8 experts (the scales given with block = (bn, bk), DeepSeek-style): one
    fp32 scale per [bn, bk] block of each projection: w_down_scale [E, ceil(H / bn), ceil(I / bk)],
    w_gate_up_scale [E, 2 * ceil(I / bn), ceil(H / bk)], the gate's block rows then the up's
    (each projection its own grid: with I a multiple of bn, the stacked [2I, H] rows' grid).
    Each GEMM's input is quantized per row and per group of bk columns (quantize_groups_fp8) and
    its product is sum_j sa[m, j] * sw[n // bn, j] * (q(a)[m] . q(W)[n] over group j), i.e. the
    float32 product of the dequantized operands, rounded to x's dtype (quant.block_fp8_linear's).
    """
    assert activation in MOE_ACTIVATIONS, activation
    if activation == "swigluoai":
        act = lambda gu: swigluoai_and_mul(gu, swiglu_alpha, swiglu_limit)
    else:
        act = silu_and_mul if activation == "silu" else gelu_tanh_and_mul

    def add_bias(y: torch.Tensor, bias: torch.Tensor | None, e: int) -> torch.Tensor:
        return y if bias is None else y + bias[e].to(y.dtype)

    fp8 = w_gate_up_scale is not None
    assert fp8 == (w_down_scale is not None), "both scales or neither"
    assert block is None or fp8, "block-scaled experts need their scales"
    if block is not None:
        bn, bk = block
        inter, hidden = w_down.shape[2], x.shape[1]

        def dequantized(a: torch.Tensor) -> torch.Tensor:  # a quantized per group of bk columns, in fp32
            q, s = quantize_groups_fp8(a, bk)
            return q.float() * s.repeat_interleave(bk, 1)[:, : a.shape[1]]

        xq = dequantized(x)
    elif fp8:
        qx, sx = quantize_rows_fp8(x)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        if block is not None:
            assert w_gate_up_scale is not None and w_down_scale is not None
            gate_blocks = -(-inter // bn)
            s_gu = w_gate_up_scale[e]
            w_gu = torch.cat([w_gate_up[e, :inter].float() * expand_blocks(s_gu[:gate_blocks], inter, hidden, block),
                              w_gate_up[e, inter:].float() * expand_blocks(s_gu[gate_blocks:], inter, hidden, block)])
            g = F.linear(xq[rows], w_gu).to(x.dtype)
            h = act(add_bias(g, w_gate_up_bias, e))
            y = F.linear(dequantized(h), w_down[e].float() * expand_blocks(w_down_scale[e], hidden, inter, block))
            y = y.to(x.dtype)
        elif fp8:
            assert w_gate_up_scale is not None and w_down_scale is not None
            g = ((qx[rows].float() @ w_gate_up[e].float().t()) * sx[rows] * w_gate_up_scale[e]).to(x.dtype)
            qh, sh = quantize_rows_fp8(act(add_bias(g, w_gate_up_bias, e)))
            y = ((qh.float() @ w_down[e].float().t()) * sh * w_down_scale[e]).to(x.dtype)
        else:
            y = F.linear(act(add_bias(F.linear(x[rows], w_gate_up[e]), w_gate_up_bias, e)), w_down[e])
        y = add_bias(y, w_down_bias, e)
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
    return out.to(x.dtype)


def route_grouped(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's (and DeepSeek-V3's) router over its float32 logits [T, E] (transformers'
    Glm4MoeTopkRouter): sigmoid scores; the choice is made on scores + bias (the load
    balancing correction), among the topk_group best of n_group equal groups of experts (a
    group scores the sum of its two best), the top k; the weights are the chosen experts'
    scores (without the bias), renormalized to sum 1 (+1e-20) if asked, times `scale`.
    Plain torch ops, also on CUDA (no host synchronisation: CUDA-graph safe).
    -> (weights [T, k] float32, ids [T, k] int32)."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if n_group > 1:
        t, e = choice.shape
        groups = choice.view(t, n_group, e // n_group)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, dim=-1, sorted=False)[1], 1.0)
        choice = choice.masked_fill(~keep.bool()[:, :, None].expand(t, n_group, e // n_group).reshape(t, e),
                                    float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids.to(torch.int32)


def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' router over its logits [T, E] (transformers' Mixtral and
    Qwen3-MoE): softmax in float32, the top k, renormalized to sum 1 if asked, rounded to
    `round_to` if given (Qwen3-MoE's cast to the hidden dtype). -> (weights [T, k]
    float32, ids [T, k] int32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to)
    return weights.float(), ids.to(torch.int32)
