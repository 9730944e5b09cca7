"""A token's routing from its router logits, in registers (`topk`): what kernels/moe_route.py's
kernels store and what kernels/moe_gemv.py's gate_up kernel can compute itself (a decode step
that defers its routing to the experts' kernel: no last program and no atomic in the router).
Same semantics as kernels.reference_moe.route_topk."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.common import round_to as _round_to


@triton.jit
def topk(z, offs, valid, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
         DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Softmax (fp32) over one token's logits z [BLOCK_E] (valid: the E real ones), the top k
    (of equal probabilities the lower expert id first; torch.topk leaves their order
    unspecified), renormalized to sum 1 (RENORM), rounded to DTYPE (ROUND) -> (weights, ids),
    both [BLOCK_E], slot j's at position j < TOPK. Each pick is one max over int64 keys (the
    probability's bits, which order as the non-negative floats do, above the complement of
    the id), not a max and then a min."""
    z = z - tl.max(z, axis=0)
    num = tl.where(valid, tl.exp(z), 0.0)
    probs = num / tl.sum(num, axis=0)
    # a row of NaN or infinite logits (hidden states gone non-finite) would pick no real
    # expert, and an id past the experts makes the GEMMs' index ops assert on the device,
    # which ends the whole process. Such a row routes to the lowest experts instead (its
    # output is non-finite anyway).
    probs = tl.where(probs == probs, probs, 0.0)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - offs), -1)
    slots = offs  # (k <= E <= BLOCK_E: the picks kept in a vector of the logits' shape)
    picked = tl.zeros([BLOCK_E], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_E], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(TOPK):
        key = tl.max(keys, axis=0)
        idx = (BLOCK_E - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
        best = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        total += best
        picked = tl.where(slots == j, best, picked)
        picked_ids = tl.where(slots == j, idx, picked_ids)
        keys = tl.where(offs == idx, -1, keys)
    w = picked / total if RENORM else picked
    if ROUND:
        w = _round_to(w, DTYPE, INTERP).to(tl.float32)
    return w, picked_ids
