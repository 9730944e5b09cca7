"""The extend (prefill) kernel of latent attention (kernels/mla_extend.py) equals kernels/mla.py's
torch reference: prefill chunks after a cached prefix, several sequences of different
lengths with one-token decodes among them, heads not a multiple of the head block and fewer
heads than a block (rows filled with queries), rope dims below and at 16, page sizes 1, 4 and
16 with shuffled pages, float32 and bfloat16; over a CUDA-graph tile list with padding
(-1 tiles, sequences without queries); and paged_mla's Triton dispatch of a mixed step
(decodes to the decode kernel, the rest to the extend kernel).

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py): small shapes. The
cuda-marked test takes the released shape (512 + 64, page 16) and a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from kernels import mla, mla_extend
from kernels.attention import extend_tiles
from tests.kernels.device import CUDA, DEVICE
from tests.kernels.test_mla_decode import case, tolerance


def batch(heads, v, r, page_size, lens, q_lens, dtype, seed=0):
    """case() with q_lens[b] queries at the end of each sequence's lens[b] tokens."""
    q, cache, page_table, seq_lens = case(heads, v, r, page_size, lens, dtype, seed, queries=sum(q_lens))
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    return q, cache, page_table, seq_lens, cu


def reference(q, cache, page_table, seq_lens, cu, scale, v):
    return mla.paged_mla(q, cache, page_table, seq_lens, cu, scale, v, kernel=False)


# (lens, q_lens): a whole prompt, chunks after cached prefixes of 5 and 40 tokens, decodes
LENS, Q_LENS = [37, 45, 1, 60, 19], [37, 5, 1, 20, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float8_cache_is_read_into_the_queries_dtype(dtype):
    """(kv_cache_dtype "fp8": see test_mla_decode.py's test of the same name.)"""
    q, cache, page_table, seq_lens, cu = batch(5, 32, 8, 4, LENS, Q_LENS, dtype)
    cache = (cache.float() * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = reference(q, cache, page_table, seq_lens, cu, 0.005, 32)
    got = mla_extend.mla_extend(q, cache, page_table, seq_lens, cu, 0.005, 32, max(Q_LENS))
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance(dtype) * 40, rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,v,r,page_size", [(5, 32, 8, 1), (3, 16, 16, 4), (17, 32, 16, 16), (16, 32, 8, 4)])
def test_extend_kernel_equals_the_reference(dtype, heads, v, r, page_size):
    q, cache, page_table, seq_lens, cu = batch(heads, v, r, page_size, LENS, Q_LENS, dtype)
    want = reference(q, cache, page_table, seq_lens, cu, 0.2, v)
    got = mla_extend.mla_extend(q, cache, page_table, seq_lens, cu, 0.2, v, max(Q_LENS))
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,block_n", [(16, 16), (64, 32)])
def test_other_row_and_key_blocks_give_the_same(rows, block_n):
    # (5 heads: a head block of 8, 2 or 8 queries a program; 16-key blocks cross 4-token pages)
    q, cache, page_table, seq_lens, cu = batch(5, 32, 16, 4, LENS, Q_LENS, torch.float32, seed=1)
    want = reference(q, cache, page_table, seq_lens, cu, 0.2, 32)
    got = mla_extend.mla_extend(q, cache, page_table, seq_lens, cu, 0.2, 32, max(Q_LENS), rows=rows, block_n=block_n)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_tile_list_with_padding_gives_the_same():
    """As ExtendGraphs runs it: a table and lengths for more sequences than the step has
    (the rest without queries), the tile list padded with -1, blocks of 32 queries."""
    q, cache, page_table, seq_lens, cu = batch(17, 32, 8, 16, LENS, Q_LENS, torch.float32, seed=2)
    want = reference(q, cache, page_table, seq_lens, cu, 0.2, 32)
    table = torch.zeros(8, page_table.shape[1] + 3, dtype=torch.int32, device=DEVICE)
    table[: len(LENS), : page_table.shape[1]] = page_table
    lens = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    lens[: len(LENS)] = seq_lens
    cu_all = torch.full((9,), int(cu[-1]), dtype=torch.int32, device=DEVICE)
    cu_all[: len(LENS) + 1] = cu
    tiles = torch.from_numpy(extend_tiles(Q_LENS, 32, pad_to=12)).to(DEVICE)
    assert (tiles == -1).any()
    got = mla_extend.mla_extend(q, cache, table, lens, cu_all, 0.2, 32, 0, tiles=tiles, block_m=32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_decodes", [0, 2])
def test_paged_mla_dispatch_of_a_mixed_step(num_decodes):
    lens, q_lens = [30, 8, 44, 12], [1, 1, 9, 12]  # (two decodes first, as packing orders them)
    q, cache, page_table, seq_lens, cu = batch(5, 16, 16, 4, lens, q_lens, torch.float32, seed=3)
    want = reference(q, cache, page_table, seq_lens, cu, 0.2, 16)
    got = mla._triton_mla(q, cache, page_table, seq_lens, cu, 0.2, 16, max(q_lens), num_decodes, None, 0, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # (all decodes: the decode kernel's path)
    got = mla._triton_mla(q[:2], cache, page_table[:2], seq_lens[:2], cu[:3], 0.2, 16, 1, 0, None, 0, None)
    torch.testing.assert_close(got, want[:2], atol=2e-5, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_released_shape_extend_on_the_gpu_and_in_a_cuda_graph(heads):
    lens, q_lens = [1, 700, 300, 2000], [1, 1, 300, 512]
    q, cache, page_table, seq_lens, cu = batch(heads, 512, 64, 16, lens, q_lens, torch.bfloat16)
    want = reference(q, cache, page_table, seq_lens, cu, 0.1, 512)
    got = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.1, 512, max_q_len=max(q_lens), num_decodes=2)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    tiles = torch.from_numpy(extend_tiles(q_lens, 64, pad_to=20)).to(DEVICE)
    # (eagerly first: the tiled variant compiles outside the capture)
    eager = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.1, 512, max_q_len=1024, tiles=tiles, block_m=64)
    torch.testing.assert_close(eager.float(), want.float(), atol=2e-2, rtol=2e-2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # (a host synchronisation here would fail the capture)
        static = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.1, 512, max_q_len=1024, tiles=tiles, block_m=64)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)
