"""The alignment of kernels/moe.py's grouped GEMM: the (token, slot) pairs sorted by expert,
each expert's group padded to a multiple of BLOCK_M, without host synchronisation
(`align_pairs`; the layout is drawn in kernels/moe.py's docstring): in one launch for up to
SMALL_CHUNKS chunks of pairs (a decode step's), in three small kernels past that."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 128
"""(token, slot) pairs per program of the alignment kernels (a [128, 128] compare ranks them)."""

SMALL_CHUNKS = 16
"""Up to this many chunks (2,048 pairs: 256 tokens of top-8) `_align_small_kernel` aligns them
in one launch, each program counting every pair itself; past it that redundant count (a
histogram of all the pairs in every program) would cost more than the two launches it saves."""


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, PAIRS, PADDED, CHUNK: tl.constexpr,
                        E_PAD: tl.constexpr, FILL: tl.constexpr):
    """counts[c, e] = pairs of chunk c routed to expert e; also fills this program's share of
    sorted_ids with the sentinel (the scatter kernel then writes the real pairs)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < PAIRS, other=-1).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E_PAD + experts, counts)
    fill = c * FILL + tl.arange(0, FILL)
    tl.store(sorted_ptr + fill, tl.full([FILL], 0, tl.int32) + PAIRS, mask=fill < PADDED)


@triton.jit
def _align_offsets_kernel(counts_ptr, block_expert_ptr, CHUNKS, BLOCKS, E: tl.constexpr, E_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, CB: tl.constexpr, BB: tl.constexpr):
    """One program: each expert's group start (its padded size, in expert order), then
    counts[c, e] := where chunk c's pairs of expert e start in sorted_ids; and
    block_expert[b] = the expert whose padded group holds M-block b (E past the last)."""
    experts = tl.arange(0, E_PAD)
    rows = tl.arange(0, CB)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, CHUNKS, CB):
        ptrs = counts_ptr + (c0 + rows)[:, None] * E_PAD + experts[None, :]
        totals += tl.sum(tl.load(ptrs, mask=(c0 + rows < CHUNKS)[:, None], other=0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    running = ends - padded
    for c0 in range(0, CHUNKS, CB):
        ptrs = counts_ptr + (c0 + rows)[:, None] * E_PAD + experts[None, :]
        mask = (c0 + rows < CHUNKS)[:, None]
        tile = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=mask)
        running += tl.sum(tile, axis=0)
    blocks = tl.arange(0, BB)
    for b0 in range(0, BLOCKS, BB):
        first_row = (b0 + blocks) * BLOCK_M
        # searchsorted(ends, first_row, right=True): the groups ending at or before the block
        past = (ends[None, :] <= first_row[:, None]) & (experts < E)[None, :]
        tl.store(block_expert_ptr + b0 + blocks, tl.sum(past.to(tl.int32), axis=1), mask=b0 + blocks < BLOCKS)


@triton.jit
def _align_scatter_kernel(ids_ptr, starts_ptr, sorted_ptr, PAIRS, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """sorted_ids[start of (chunk, expert) + rank among the chunk's pairs of that expert] = pair."""
    c = tl.program_id(0)
    idx = tl.arange(0, CHUNK)
    offs = c * CHUNK + idx
    valid = offs < PAIRS
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    before = (ids[:, None] == ids[None, :]) & (idx[None, :] < idx[:, None])
    rank = tl.sum(before.to(tl.int32), axis=1)
    start = tl.load(starts_ptr + c * E_PAD + tl.where(valid, ids, 0), mask=valid, other=0)
    tl.store(sorted_ptr + start + rank, offs.to(tl.int32), mask=valid)



@triton.jit
def _align_small_kernel(ids_ptr, sorted_ptr, block_expert_ptr, PAIRS, PADDED, BLOCKS, CHUNKS,
                        E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        ALL: tl.constexpr, FILL: tl.constexpr, BB: tl.constexpr):
    """The three kernels below in one launch, for a few chunks: program c counts every pair per
    expert itself (two histograms of all the pairs: the totals, and the chunks' before its own),
    so each program knows every group's start without waiting for another; it scatters its own
    chunk, then writes its share of the rest: the padding of the experts e with e % CHUNKS == c,
    the sentinel past the last group in its FILL positions, and block_expert for its BB blocks.
    ALL: a power of two >= PAIRS (at least CHUNK: no degenerate one-element histograms)."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    every = tl.arange(0, ALL)
    all_ids = tl.load(ids_ptr + every, mask=every < PAIRS, other=0).to(tl.int32)
    # (histograms, not [pairs, E] compares: the count was most of this kernel's 12 us at 1,024 pairs)
    totals = tl.histogram(all_ids, E_PAD, mask=every < PAIRS)
    before = tl.histogram(all_ids, E_PAD, mask=every < tl.minimum(PAIRS, c * CHUNK))
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # this chunk's pairs: its group's start + the pairs of its expert in earlier chunks + rank
    idx = tl.arange(0, CHUNK)
    offs = c * CHUNK + idx
    valid = offs < PAIRS
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    base = tl.gather(starts + before, ids, 0)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (idx[None, :] < idx[:, None])).to(tl.int32), axis=1)
    tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=valid)
    # the padding after each group (fewer than BLOCK_M rows), the sentinel
    j = tl.arange(0, BLOCK_M)
    mine = (experts % CHUNKS == c) & (experts < E)
    pad = mine[:, None] & (j[None, :] < (padded - totals)[:, None])
    sentinel = tl.full([E_PAD, BLOCK_M], 0, tl.int32) + PAIRS
    tl.store(sorted_ptr + (starts + totals)[:, None] + j[None, :], sentinel, mask=pad)
    # the tail past the last group, up to the worst case's length
    last = tl.sum(padded, axis=0)
    fill = c * FILL + tl.arange(0, FILL)
    tl.store(sorted_ptr + fill, tl.full([FILL], 0, tl.int32) + PAIRS, mask=(fill >= last) & (fill < PADDED))
    # block b's expert: searchsorted(ends, b * BLOCK_M, right=True) (E past the last group)
    blocks = c * BB + tl.arange(0, BB)
    past = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & (experts < E)[None, :]
    tl.store(block_expert_ptr + blocks, tl.sum(past.to(tl.int32), axis=1), mask=blocks < BLOCKS)


def align_pairs(topk_ids: torch.Tensor, experts: int, block_m: int,
                small: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [padded] int32, block_expert [padded / block_m] int32): the (token, slot)
    pairs grouped by expert in pair order (a stable sort), each group padded to a multiple
    of block_m with the sentinel T*k; tail blocks past the last group carry expert E.
    No host sync. Up to SMALL_CHUNKS chunks of ALIGN_CHUNK pairs, one kernel
    (`_align_small_kernel`); past that three: count per chunk (and fill the sentinel), each
    (chunk, expert)'s start in one program, then each chunk scatters its pairs (rank = earlier
    pairs of the chunk with the same expert). small: force one way (tests)."""
    flat = topk_ids.reshape(-1).contiguous()
    pairs = flat.numel()
    dev = flat.device
    padded_len = triton.cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m) * block_m
    blocks = padded_len // block_m
    chunks = triton.cdiv(pairs, ALIGN_CHUNK)
    e_pad = triton.next_power_of_2(experts)
    sorted_ids = torch.empty((padded_len,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((blocks,), dtype=torch.int32, device=dev)
    fill = triton.next_power_of_2(triton.cdiv(padded_len, chunks))
    if chunks <= SMALL_CHUNKS if small is None else small:
        _align_small_kernel[(chunks,)](flat, sorted_ids, block_expert, pairs, padded_len, blocks, chunks, E=experts,
                                       E_PAD=e_pad, BLOCK_M=block_m, CHUNK=ALIGN_CHUNK,
                                       ALL=max(ALIGN_CHUNK, triton.next_power_of_2(pairs)), FILL=fill,
                                       BB=triton.next_power_of_2(triton.cdiv(blocks, chunks)),
                                       num_warps=8 if e_pad >= 128 else 4)  # (ptxas, sm_90a: 128 experts, 128 regs)
        return sorted_ids, block_expert
    counts = torch.empty((chunks, e_pad), dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](flat, counts, sorted_ids, pairs, padded_len, CHUNK=ALIGN_CHUNK, E_PAD=e_pad,
                                   FILL=fill)
    _align_offsets_kernel[(1,)](counts, block_expert, chunks, blocks, E=experts, E_PAD=e_pad, BLOCK_M=block_m,
                                CB=max(1, min(16, 4096 // e_pad)), BB=max(16, min(256, 8192 // e_pad)))
    _align_scatter_kernel[(chunks,)](flat, counts, sorted_ids, pairs, CHUNK=ALIGN_CHUNK, E_PAD=e_pad)
    return sorted_ids, block_expert
