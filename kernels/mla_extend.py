"""Triton extend (prefill) kernel of multi-head latent attention: kernels/mla.py's paged_mla
for packed varlen queries (prefill chunks after a cached prefix, decodes mixed in).

A program takes BLOCK_T consecutive queries of one sequence for BLOCK_H heads: its
BLOCK_T x BLOCK_H rows (row r is query r // BLOCK_H, head r % BLOCK_H) are one matrix against
each block of BLOCK_N latent keys: scores q_lat . c + q_rope . k_rope in float32, online
softmax (exp2 domain), acc += p . c (values = the keys' first V dims). Heads share their
keys (one latent "KV head"), so heads and queries fill the rows together: a decode mixed
into the step is 1 x BLOCK_H live rows, not one live row per program as one head per
program would give, and a prompt's keys are read once per BLOCK_T x BLOCK_H rows.

Query i of sequence b sits at position seq_lens[b] - q_len_b + i and sees the keys up to its
own (already in the pages: store_latent runs first). Keys before the program's first query
are seen by every row and run without masks; from there to its last query, the causal mask.

Grid (cdiv(max_q_len, BLOCK_T), head blocks, B), or with a tile list
(kernels/attention/extend.py extend_tiles: entry b << 16 | m for query block m of sequence
b, -1 padding) built for blocks of TILE_M queries, (len(tiles) * TILE_M / BLOCK_T, head
blocks): the grid then depends on the tile list's length only, so a CUDA graph captured for a
padded token count (model/graphs.py ExtendGraphs) serves any batch that fits. No host
synchronisation. V and R: powers of two (kernels/mla_decode.py supported).

Tested against kernels/mla.py under TRITON_INTERPRET=1 (tests/kernels/test_mla_extend.py);
not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES, interpreting, pdl_enabled, pdl_enter, round_to
from kernels.mla_decode import HEAD_BLOCK, LOG2E, compute_dtype, latent_block

ROWS = 32
"""Rows (queries x heads) per program. At 512 + 64 dims (bf16, sm_90a; benchmarks/ptxas_regs.py
mla) 32 rows over 8 warps with 32-key blocks take 218 registers a thread, no spills (16-key
blocks 234); 64 rows spilled 220 bytes, 32 rows over 4 warps 16."""


@triton.jit(
    do_not_specialize=["stride_pb"], do_not_specialize_on_alignment=["pt_ptr", "seq_lens_ptr", "cu_ptr", "tiles_ptr"]
)
def _mla_extend_kernel(
    q_ptr, cache_ptr, pt_ptr, seq_lens_ptr, cu_ptr, tiles_ptr, out_ptr,
    stride_qt, stride_qh, stride_cp, stride_cs, stride_pb, stride_ot, stride_oh,
    H, qk_scale,
    V: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILED: tl.constexpr, COMPUTE: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROPE_DOT: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    if TILED:
        # TILE_M // BLOCK_T programs per tile, each BLOCK_T of the tile's queries
        tile = tl.load(tiles_ptr + tl.program_id(0) // (TILE_M // BLOCK_T))
        live = tile >= 0
        b = tl.where(live, tile >> 16, 0)
        t0 = (tile & 0xFFFF) * TILE_M + (tl.program_id(0) % (TILE_M // BLOCK_T)) * BLOCK_T
    else:
        live = True
        t0 = tl.program_id(0) * BLOCK_T
        b = tl.program_id(2)
    q_start = tl.load(cu_ptr + b).to(tl.int32)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int32) - q_start
    if live & (t0 < q_len):
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        first = seq_len - q_len + t0  # the position of the program's first query
        rows = tl.arange(0, BLOCK_T * BLOCK_H)
        i = t0 + rows // BLOCK_H
        heads = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
        rmask = (i < q_len) & (heads < H)
        # rows past the sequence's queries (i >= q_len) read no q and store nothing; their
        # positions are past seq_len, so they see every key and stay finite
        qpos = first - t0 + i
        tok = (q_start + i).to(tl.int64)
        dv = tl.arange(0, V)
        dr = tl.arange(0, R)
        q_row = q_ptr + tok[:, None] * stride_qt + heads[:, None].to(tl.int64) * stride_qh
        q_lat = tl.load(q_row + dv[None, :], mask=rmask[:, None], other=0.0).to(COMPUTE)
        q_rope = tl.load(q_row + V + dr[None, :], mask=rmask[:, None], other=0.0).to(COMPUTE)
        m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T * BLOCK_H, V], dtype=tl.float32)
        pt_row = pt_ptr + b.to(tl.int64) * stride_pb
        # whole blocks before the first query: seen by every row, no mask
        full_end = first // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = latent_block(
                q_lat, q_rope, cache_ptr, pt_row, n0, seq_len, qpos, m_i, l_i, acc, qk_scale, stride_cp, stride_cs,
                V, R, PAGE, BLOCK_N, False, False, COMPUTE, PRECISION, ROPE_DOT, INTERP,
            )  # fmt: skip
        # from there to the last query: causal (key full_end <= first is seen by every row)
        end = tl.minimum(first + BLOCK_T, seq_len)
        for n0 in range(full_end, end, BLOCK_N):
            m_i, l_i, acc = latent_block(
                q_lat, q_rope, cache_ptr, pt_row, n0, end, qpos, m_i, l_i, acc, qk_scale, stride_cp, stride_cs,
                V, R, PAGE, BLOCK_N, True, True, COMPUTE, PRECISION, ROPE_DOT, INTERP,
            )  # fmt: skip
        out = acc / l_i[:, None]
        o_row = out_ptr + tok[:, None] * stride_ot + heads[:, None].to(tl.int64) * stride_oh
        tl.store(o_row + dv[None, :], round_to(out, OUT_DTYPE, INTERP), mask=rmask[:, None])


def head_block(heads: int) -> int:
    """Heads per program: 16, fewer for fewer heads (the rows are then filled with queries)."""
    return min(HEAD_BLOCK, triton.next_power_of_2(heads))


def mla_extend(
    q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor,
    scale: float, v_dim: int, max_q_len: int, tiles: torch.Tensor | None = None, block_m: int = 0,
    out: torch.Tensor | None = None, rows: int = ROWS, block_n: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries q [T, H, V + R] (sequence b's at cu_q_lens[b] ..
    cu_q_lens[b + 1]) over the latent cache [P, S, 1, V + R] through page_table [B, max_pages]
    -> [T, H, V] in q's dtype (written into `out` when given: unit stride over V).

    max_q_len: a host bound of the per-sequence query counts (sizes the grid; unused with
    tiles). tiles: int32 tile list from extend_tiles(q_lens, block_m) (padding -1); the grid
    then depends on its length only. rows, block_n, num_warps: tuning (tests)."""
    t, h, _ = q.shape
    if out is None:
        out = torch.empty((t, h, v_dim), dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0 or (tiles is None and max_q_len <= 0):
        return out
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    r = q.shape[-1] - v_dim
    block_h = head_block(h)
    block_t = max(1, rows // block_h)
    if tiles is not None:
        assert block_m > 0, "a tile list is built for one block size"
        block_t = min(block_t, block_m)  # (block_m: a power of two >= 16)
        assert block_m % block_t == 0
        grid: tuple[int, ...] = (tiles.shape[0] * (block_m // block_t), triton.cdiv(h, block_h))
    else:
        grid = (triton.cdiv(max_q_len, block_t), triton.cdiv(h, block_h), batch)
    if block_n is None:
        block_n = 32
    if num_warps is None:
        num_warps = 8 if block_t * block_h * v_dim >= 16384 else 4
    compute = compute_dtype(q.dtype)
    pdl = pdl_enabled(q)
    _mla_extend_kernel[grid](
        q, cache, page_table, seq_lens, cu_q_lens, cu_q_lens if tiles is None else tiles, out,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        h, float(scale) * LOG2E,
        V=v_dim, R=r, PAGE=cache.shape[1], BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_N=block_n,
        TILE_M=block_m if tiles is not None else block_t, TILED=tiles is not None,
        COMPUTE=compute, OUT_DTYPE=TL_DTYPES[q.dtype], PRECISION="ieee" if compute == tl.float32 else "tf32",
        ROPE_DOT=r >= 16, INTERP=interpreting(), PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out
