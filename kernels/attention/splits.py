"""How a split-KV decode is divided and merged: the host's split count (shapes only, so
CUDA-graph safe) and the kernel that merges the splits' partial outputs by their
log-sum-exp, and adds the attention sinks (kernels/attention/decode.py runs both around its
main kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to
from kernels.common import sm_count


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    sinks_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out[b, h] = the splits' partial outputs weighted by their share of the softmax mass
    (log-sum-exps in the exp2 domain); with HAS_SINKS, head h's sink is one more share of the
    mass with a zero output (added here once, not by every split)."""
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (b * H + h) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634  # natural log -> exp2 domain
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w = tl.where(s_mask, w, 0.0)
    o = tl.load(
        part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, _round_to(res, OUT_DTYPE, INTERP), mask=d_mask)


def _choose_splits(
    batch: int, kv_heads: int, max_seq_len: int, block_n: int, device: torch.device, per_sm: int = 4
) -> int:
    """Host-side heuristic from shapes only (CUDA-graph safe). per_sm: programs resident per SM."""
    if device.type == "cuda":
        sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 4
    # about one resident wave of programs, but each split keeps >= 2 key blocks
    # (benchmarks/profile_gpu.py attn-b1, batch 1, 1024 tokens of a 2048-token graph: 16
    # splits 6.9 us against 8.3 for 8; shorter contexts use fewer splits either way)
    want = (per_sm * sms) // max(1, batch * kv_heads)
    most = max(1, triton.cdiv(max_seq_len, 2 * block_n))
    return int(max(1, min(want, most, 64)))
