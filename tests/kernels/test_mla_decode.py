"""The split-KV decode kernel of latent attention (kernels/mla_decode.py) equals kernels/mla.py's
torch reference: one split and several (splits past a short sequence's end are empty), the
split count chosen from shapes, heads not a multiple of the head block, rope dims below and
at 16 (the broadcast and the tl.dot products), page sizes 1, 4 and 16 with shuffled pages
and partial last pages, float32 and bfloat16, lengths 1 to past several key blocks. The
latent store (kernels/kv_store.py, K alone) skips slots of -1 as the reference does.

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py): small shapes. The
cuda-marked tests take the released shape (512 + 64, page 16) and capture the decode in a
CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from kernels import kv_store, mla, mla_decode
from tests.kernels.device import CUDA, DEVICE


def case(heads: int, v: int, r: int, page_size: int, lens: list[int], dtype: torch.dtype, seed: int = 0,
         queries: int | None = None):
    """(q [queries or len(lens), heads, v + r], cache, page_table, seq_lens): each sequence's
    pages shuffled over the cache (page 0 never used, as the pool's scratch page)."""
    gen = torch.Generator().manual_seed(seed)
    pages_of = [-(-n // page_size) for n in lens]
    perm = (torch.randperm(sum(pages_of), generator=gen) + 1).tolist()
    page_table = torch.zeros(len(lens), max(pages_of), dtype=torch.int32)
    for b, n in enumerate(pages_of):
        page_table[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    cache = torch.randn(sum(pages_of) + 1, page_size, 1, v + r, generator=gen).to(dtype)
    q = torch.randn(len(lens) if queries is None else queries, heads, v + r, generator=gen).to(dtype)
    return q.to(DEVICE), cache.to(DEVICE), page_table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2  # (bf16: p rounded for the P x V product)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,v,r,page_size", [(5, 32, 8, 1), (3, 16, 16, 4), (17, 32, 16, 16)])
def test_decode_kernel_equals_the_reference(dtype, heads, v, r, page_size, splits):
    lens = [1, 7, 33, 70]  # (7, 33, 70: partial last pages of 4 and 16; 1 with 8 splits: 7 empty)
    q, cache, page_table, seq_lens = case(heads, v, r, page_size, lens, dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    want = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.2, v, kernel=False)
    assert mla_decode.supported(q, cache, v)
    got = mla_decode.mla_decode(q, cache, page_table, seq_lens, 0.2, v, num_splits=splits)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float8_cache_is_read_into_the_queries_dtype(dtype, splits):
    """kv_cache_dtype "fp8": the latent cache float8 (as stored: rounded, saturated), the queries
    in the model's dtype; the kernel reads it as the reference does."""
    q, cache, page_table, seq_lens = case(5, 32, 8, 4, [1, 7, 33, 70], dtype)
    cache = (cache.float() * 40).clamp(-448, 448).to(torch.float8_e4m3fn)  # (past +-448 saturated by the store)
    cu = torch.arange(5, dtype=torch.int32, device=DEVICE)
    want = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.005, 32, kernel=False)
    assert mla_decode.supported(q, cache, 32)
    got = mla_decode.mla_decode(q, cache, page_table, seq_lens, 0.005, 32, num_splits=splits)
    tol = tolerance(dtype) * 40
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tolerance(dtype))


def test_the_float8_latent_store_saturates_as_the_reference_does():
    gen = torch.Generator().manual_seed(2)
    latent = (torch.randn(4, 1, 24, generator=gen) * 300).to(DEVICE)  # (some past +-448)
    slots = torch.tensor([0, 5, 9, 14], device=DEVICE)
    want = torch.zeros(4, 4, 1, 24, dtype=torch.float8_e4m3fn)
    mla.store_latent(latent.cpu(), want, slots.cpu())
    assert want.float().abs().max() == 448 and not want.float().isnan().any()
    got = torch.zeros(4, 4, 1, 24, dtype=torch.float8_e4m3fn, device=DEVICE)
    kv_store.store_kv(latent, None, got, None, slots)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("splits", [1, 3])
def test_the_released_dims_512_and_64(splits):
    # (the splits' merge takes 512 value dims in two passes of 256)
    q, cache, page_table, seq_lens = case(3, 512, 64, 16, [5, 40], torch.float32)
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    want = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.05, 512, kernel=False)
    got = mla_decode.mla_decode(q, cache, page_table, seq_lens, 0.05, 512, num_splits=splits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_the_split_count_comes_from_shapes_and_a_lone_long_decode_splits():
    q, cache, page_table, seq_lens = case(5, 32, 8, 16, [300], torch.float32)
    # (a 1,024-token graph-wide table: the count follows its width, not the length 300)
    table = torch.zeros(1, 64, dtype=torch.int32, device=DEVICE)
    table[:, : page_table.shape[1]] = page_table
    n = mla_decode.num_splits_for(1, 5, 64 * 16, q.device)
    assert n > 1 and n == mla_decode.num_splits_for(1, 5, 64 * 16, q.device)
    assert mla_decode.num_splits_for(1, 5, 100, q.device) == 1  # (too short to split)
    assert mla_decode.num_splits_for(64, 5, 64 * 16, q.device) < n  # (a batch fills the SMs itself)
    cu = torch.arange(2, dtype=torch.int32, device=DEVICE)
    want = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.3, 32, kernel=False)
    got = mla_decode.mla_decode(q, cache, table, seq_lens, 0.3, 32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_writes_into_the_rows_it_is_given():
    q, cache, page_table, seq_lens = case(4, 16, 16, 4, [9, 20], torch.float32)
    out = torch.full((3, 4, 16), 7.0, device=DEVICE)
    mla_decode.mla_decode(q, cache, page_table, seq_lens, 0.2, 16, num_splits=2, out=out[1:])
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(out[1:], mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.2, 16, kernel=False),
                               atol=2e-5, rtol=2e-5)
    assert (out[0] == 7.0).all()


def test_shapes_the_kernel_does_not_take_fall_back():
    q, cache, _, _ = case(2, 24, 8, 4, [3], torch.float32)
    assert not mla_decode.supported(q, cache, 24)  # (24: not a power of two)
    q, cache, _, _ = case(2, 32, 8, 4, [3], torch.float32)
    assert not mla_decode.supported(q.to(torch.bfloat16), cache, 32)  # (dtypes differ)
    assert mla_decode.supported_dims(512, 64, torch.bfloat16) and not mla_decode.supported_dims(512, 48, torch.bfloat16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_latent_store_skips_padding_as_the_reference_does(page_size):
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(5, 1, 24, generator=gen).to(DEVICE)
    slots = torch.tensor([3 * page_size, -1, 2 * page_size + page_size - 1, -1, 4 * page_size], device=DEVICE)
    before = torch.randn(6, page_size, 1, 24, generator=gen)
    want = before.clone()
    mla.store_latent(latent.cpu(), want, slots.cpu())  # (the torch path)
    got = before.clone().to(DEVICE)
    kv_store.store_kv(latent, None, got, None, slots)
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)
    assert (want != before).any(dim=-1).sum() == 3  # (three rows written, the padding's not)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_released_shape_decode_on_the_gpu_and_in_a_cuda_graph(heads):
    lens = [1, 700, 4000]
    q, cache, page_table, seq_lens = case(heads, 512, 64, 16, lens, torch.bfloat16)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    want = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.1, 512, kernel=False)
    eager = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.1, 512, max_q_len=1)
    torch.testing.assert_close(eager.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert mla_decode.num_splits_for(len(lens), heads, page_table.shape[1] * 16, q.device) > 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # (a host synchronisation here would fail the capture)
        static = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.1, 512, max_q_len=1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)
