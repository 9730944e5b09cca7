"""The Triton decode kernel of latent attention (kernels/mla_decode.py) equals kernels/mla.py's
torch reference: heads not a multiple of the head block, rope dims below and at 16 (the
broadcast and the tl.dot products), page sizes 1, 4 and 16 with shuffled pages, float32
and bfloat16, lengths 1 to past several key blocks. Through paged_mla, a mixed batch sends
its decodes to the kernel on CUDA and gives the reference's result.

Interpreted on CPU, compiled on CUDA (see tests/kernels/device.py): small shapes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import mla, mla_decode
from tests.kernels.device import CUDA, DEVICE


def case(heads: int, v: int, r: int, page_size: int, lens: list[int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pages_of = [-(-n // page_size) for n in lens]
    perm = (torch.randperm(sum(pages_of), generator=gen) + 1).tolist()
    page_table = torch.zeros(len(lens), max(pages_of), dtype=torch.int32)
    for b, n in enumerate(pages_of):
        page_table[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    cache = torch.randn(sum(pages_of) + 1, page_size, 1, v + r, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, v + r, generator=gen).to(dtype)
    return q.to(DEVICE), cache.to(DEVICE), page_table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,v,r,page_size", [(5, 32, 8, 1), (3, 16, 16, 4), (17, 32, 16, 16)])
def test_decode_kernel_equals_the_reference(dtype, heads, v, r, page_size):
    lens = [1, 7, 33, 70]
    q, cache, page_table, seq_lens = case(heads, v, r, page_size, lens, dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    want = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.2, v)
    assert mla_decode.supported(q, cache, v)
    got = mla_decode.mla_decode(q, cache, page_table, seq_lens, cu[:-1], 0.2, v)
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # (bf16: p rounded for the P x V product)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_shapes_the_kernel_does_not_take_fall_back():
    q, cache, _, _ = case(2, 24, 8, 4, [3], torch.float32)
    assert not mla_decode.supported(q, cache, 24)  # (24: not a power of two)
    q, cache, _, _ = case(2, 32, 8, 4, [3], torch.float32)
    assert not mla_decode.supported(q.to(torch.bfloat16), cache, 32)  # (dtypes differ)


@pytest.mark.skipif(not CUDA, reason="paged_mla sends decodes to the kernel on CUDA only")
def test_a_mixed_batch_through_paged_mla_on_cuda():
    v, r = 32, 16
    q, cache, page_table, seq_lens = case(6, v, r, 4, [9, 40, 12, 5], torch.bfloat16)
    q_lens = [1, 1, 6, 1]  # (decodes around a prefill chunk)
    q = torch.randn(sum(q_lens), 6, v + r, device=DEVICE).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 2, 8, 9], dtype=torch.int32, device=DEVICE)
    got = mla.paged_mla(q, cache, page_table, seq_lens, cu, 0.2, v)
    want = torch.cat([mla.paged_mla(q[a:b], cache, page_table[i:i + 1], seq_lens[i:i + 1],
                                    torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE), 0.2, v, kernel=False)
                      for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:]))])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
