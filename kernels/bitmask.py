"""Grammar bitmask applied to logits, in place: logits[r, t] = -inf where bit t of row r is 0.

The mask is xgrammar's packed layout: int32 words [rows, ceil(V/32)], bit t % 32 of word
t // 32 for token t (a row of all ones allows everything). Tokens past the mask's width
are disallowed.

One program per (row, BLOCK tokens): it loads BLOCK / 32 words once, expands each bit
in registers and stores -inf only where a token is disallowed. A constrained row is
almost all -inf, so this is one read and one write of the logits: bandwidth bound,
~15 us for 64 rows of a 128k vocabulary on an H200. `rows` (a device int tensor) picks
the rows to mask: mask row r applies to logits row r, for r in rows (xgrammar's `indices`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_kernel(
    logits_ptr,
    words_ptr,
    rows_ptr,
    V,
    W,
    stride_l,
    stride_w,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i) if HAS_ROWS else i
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word = offs // 32
    bits = tl.load(words_ptr + row.to(tl.int64) * stride_w + word, mask=word < W, other=0)
    allowed = ((bits >> (offs % 32)) & 1) != 0
    ptrs = logits_ptr + row.to(tl.int64) * stride_l + offs
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask=(offs < V) & ~allowed)


def apply_bitmask_(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits [N, V] (float, on the device of words) masked in place by words [N, W] int32;
    rows: int tensor of the rows to mask (default: all N)."""
    assert logits.dim() == 2 and words.dim() == 2 and words.dtype == torch.int32
    assert logits.stride(-1) == 1 and words.stride(-1) == 1
    assert words.shape[0] >= logits.shape[0], "a mask row for every logits row"
    r = logits.shape[0] if rows is None else rows.numel()
    v = logits.shape[1]
    if r == 0 or v == 0:
        return
    grid = (r, triton.cdiv(v, BLOCK))
    _apply_kernel[grid](
        logits,
        words,
        rows if rows is not None else words,
        v,
        words.shape[1],
        logits.stride(0),
        words.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )
