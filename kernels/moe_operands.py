"""The operands of the MoE kernels (kernels/moe.py's grouped GEMM, kernels/moe_gemv.py's
GEMV) as both prepare them: activation constants, expert biases, and float8 experts' inputs
and scales.

Float8 experts come two ways, named as kernels.reference_moe.fused_moe names them:
  per row     w_gate_up_scale [E, 2I], w_down_scale [E, H] (block None); each GEMM's input
              quantized per row (quantize_rows), one scale per row.
  per block   block = (bn, bk): w_gate_up_scale [E, 2 * ceil(I / bn), ceil(H / bk)] (the
              gate's block rows, then the up's), w_down_scale [E, ceil(H / bn), ceil(I / bk)];
              each GEMM's input quantized per row and per group of bk columns
              (quantize_groups), scales [M, ceil(K / bk)]. The kernels scale each K tile's
              partial product, so their K tile must lie in one group: `group_tile`.
"""

from __future__ import annotations

import torch

from kernels import reference


def act_constants(activation: str, alpha: float, limit: float) -> dict[str, str | float]:
    """The MoE kernels' activation constexprs (kernels.activation.moe_glu's ACT, ALPHA, LIMIT)."""
    assert activation in reference.MOE_ACTIVATIONS, activation
    return {"ACT": activation, "ALPHA": float(alpha), "LIMIT": float(limit)}


def bias_operand(bias: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """An expert bias [E, N] contiguous in x's dtype (the reference adds it in x's dtype), or
    x as an unread placeholder when there is none (the kernel's HAS_BIAS off)."""
    if bias is None:
        return x
    assert bias.shape == shape, f"expert bias of shape {tuple(bias.shape)}, expected {shape}"
    return bias.to(x.dtype).contiguous()


def fp8_operands(
    x: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
    block: tuple[int, int] | None = None,
    w_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scaled, x or its float8 rows, x's scales, the two weight scales): float8 experts when
    the scales are given (both or neither), x quantized per row (or x_rows, quantize_rows(x)
    made by the caller), or per row and group of bk columns with `block` (the scales' grids then
    checked against w_shapes, the shapes [E, 2I, H] and [E, H, I] of the weights); otherwise x
    contiguous and unread placeholders."""
    scaled = w_gate_up_scale is not None
    assert scaled == (w_down_scale is not None), "both scales or neither"
    assert block is None or scaled, "block-scaled experts need their scales"
    x = x.contiguous()
    if w_gate_up_scale is None or w_down_scale is None:
        return False, x, x, x, x
    if block is None and x_rows is not None:
        q, sx = x_rows[0], x_rows[1].reshape(-1)
        assert q.shape == x.shape and sx.shape == (x.shape[0],), "x_rows: x's float8 rows and one scale a row"
    elif block is None:
        q, sx = quantize_rows(x)
    else:
        assert w_shapes is not None
        (e, two_i, h), (_, _, i) = w_shapes
        bn, bk = block
        want = ((e, 2 * -(-i // bn), -(-h // bk)), (e, -(-h // bn), -(-i // bk)))
        got = (tuple(w_gate_up_scale.shape), tuple(w_down_scale.shape))
        assert got == want, f"block scales of shapes {got}, expected {want} for blocks {block}"
        q, sx = quantize_groups(x, bk)
    return True, q, sx, w_gate_up_scale.float().contiguous(), w_down_scale.float().contiguous()


def quantize_rows(a: torch.Tensor, live: tuple[torch.Tensor, int] | None = None,
                  div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 rows, fp32 scales [M]) of kernels.reference.quantize_rows_fp8: the Triton
    kernel on CUDA, the reference in the interpreter. live = (sorted_ids, pairs): row r only
    where sorted_ids[r // div] < pairs (kernels/moe.py's intermediate, div rows per pair row;
    the Triton kernel everywhere, the other rows left unwritten: their readers mask them off)."""
    from kernels import ops, quant  # (ops imports the MoE modules lazily)

    if live is not None:
        q, s = quant.quantize_rows_fp8(a, (live[0], live[1], div))
    else:
        q, s = ops.quantize_rows_fp8(a) if a.is_cuda else reference.quantize_rows_fp8(a)
    return q, s.reshape(-1).contiguous()


def quantize_groups(a: torch.Tensor, group: int,
                    live: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [M, K], fp32 scales [M, ceil(K / group)] contiguous) of
    kernels.reference.quantize_groups_fp8 (block-scaled experts' inputs). Where K is a multiple
    of the group each group is a row of quantize_rows (the Triton kernel on CUDA, or with `live`
    as there): the same bits, as the reference quantizes each group with quantize_rows_fp8."""
    m, k = a.shape
    if k % group or not (a.is_cuda or live is not None):
        q, s = reference.quantize_groups_fp8(a, group)
        return q, s.contiguous()
    q, s = quantize_rows(a.contiguous().view(m * (k // group), group), live, k // group)
    return q.view(m, k), s.view(m, k // group)


def group_tile(block_k: int, group: int, least: int) -> int:
    """The K tile of a block-scaled GEMM: the largest power of two that divides the group of bk
    columns, up to block_k (or `least`, tl.dot's or the float8 tl.dot's minimum K), so that
    each tile's partial product takes one scale of the input row and one of the W row."""
    tile = min(group & -group, max(block_k, least))
    assert tile >= least, (f"block-scaled float8 experts with bk {group}: the kernels' K tile must divide bk and "
                           f"be a power of two of at least {least}")
    return tile
