"""How a split-KV decode is divided and merged: the host's split count (shapes only, so
CUDA-graph safe) and the kernel that merges the splits' partial outputs by their
log-sum-exp, and adds the attention sinks (kernels/attention/decode.py runs both around its
main kernel; so does latent attention's decode, kernels/mla_decode.py).

The partial outputs: float32 [B, H, num_splits, head_dim], each split's output normalized by
its own softmax mass; the log-sum-exps float32 [B, H, num_splits] in the exp2 domain (log2 of
the mass plus the split's running maximum, both of scores times log2(e)), -inf for a split
that saw no key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES, interpreting, sm_count
from kernels.common import pdl_enter as _pdl_enter
from kernels.common import round_to as _round_to


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
    s_mask = offs_s < num_splits
    row = (b * H + h) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634  # natural log -> exp2 domain
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w = tl.where(s_mask, w, 0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    inv = 1.0 / tl.where(denom > 0, denom, 1.0)
    # a split with no key left its partial output unwritten (its weight is 0 either way)
    live = s_mask & (lse > float("-inf"))
    # BLOCK_D dims at a time: one pass where BLOCK_D covers the head (the ordinary decode),
    # several for latent attention's 512 value dims (a [splits, 512] float32 tile at once
    # would not fit in registers)
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        o = tl.load(
            part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=live[:, None] & d_mask[None, :],
            other=0.0,
        )
        res = tl.sum(o * w[:, None], 0) * inv
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, _round_to(res, OUT_DTYPE, INTERP), mask=d_mask)


def _choose_splits(
    batch: int, kv_heads: int, max_seq_len: int, block_n: int, device: torch.device, per_sm: int = 4
) -> int:
    """Host-side heuristic from shapes only (CUDA-graph safe). per_sm: programs resident per SM."""
    if device.type == "cuda":
        sms = sm_count(device)
    else:
        sms = 4
    # about one resident wave of programs, but each split keeps >= 2 key blocks
    # (benchmarks/profile_gpu.py attn-b1, batch 1, 1024 tokens of a 2048-token graph: 16
    # splits 6.9 us against 8.3 for 8; shorter contexts use fewer splits either way)
    want = (per_sm * sms) // max(1, batch * kv_heads)
    most = max(1, triton.cdiv(max_seq_len, 2 * block_n))
    return int(max(1, min(want, most, 64)))


def merge_splits(
    part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor, has_sinks: bool, pdl: bool
) -> None:
    """out [B, H, head_dim] (unit stride over head_dim) = the merge of the splits' part_o
    [B, H, S, head_dim] by part_lse [B, H, S] (see the module docstring); sinks: float32 [H],
    read only with has_sinks (else any tensor)."""
    batch, h, num_splits, d = part_o.shape
    block_s = triton.next_power_of_2(num_splits)
    # (head dims up to 256 in one pass, as before latent attention; 512 in two)
    block_d = min(triton.next_power_of_2(d), 256)
    _decode_reduce_kernel[(batch, h)](
        part_o, part_lse, sinks, out, out.stride(0), out.stride(1),
        H=h, HEAD_DIM=d, num_splits=num_splits, BLOCK_S=block_s, BLOCK_D=block_d, OUT_DTYPE=TL_DTYPES[out.dtype],
        INTERP=interpreting(), PDL=pdl, HAS_SINKS=has_sinks,
        num_warps=4 if block_d * num_splits >= 2048 else 1, launch_pdl=pdl,
    )  # fmt: skip
