"""HostTier: host pages in the device pool's format, copied bit for bit both ways."""

import pytest
import torch

from streamer.kv.host import HostPool, HostTier, _runs
from streamer.kv.pages import PagePool


def pool_of(dtype, pages=9):
    pool = PagePool(3, pages, 4, 2, 8, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(dtype))
    return pool


def test_host_pages_have_their_own_free_list_and_check_catches_a_lost_page():
    host = HostPool(pool_of(torch.float32), 5, pin=False)
    a = host.alloc(3)
    assert a == [0, 1, 2] and host.num_free == 2
    assert host.alloc(3) is None and host.num_free == 2, "a failed alloc takes nothing"
    host.check(a)
    with pytest.raises(AssertionError):
        host.check(a[:2])  # page 2 is neither free nor held
    host.free(a[:1])
    with pytest.raises(AssertionError):
        host.free(a[:1])
    host.check(a[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_page_goes_to_the_host_and_comes_back_bit_for_bit(dtype):
    pool = pool_of(dtype)
    tier = HostTier(pool, 4 * 2 * 3 * pool.k_bytes.shape[2])  # room for exactly 4 pages
    assert tier.host.num_pages == 4
    assert tier.host.data.dtype == torch.uint8, "raw bytes: a float8 page stays float8"
    k0, v0 = pool.k.clone(), pool.v.clone()
    tier.write([3, 5, 6], [2, 0, 1])
    pool.k.zero_()
    pool.v.zero_()
    assert tier.load([2, 0, 1], [7, 1, 2]) is None, "on CPU the copy is done at once"
    for src, dst in ((3, 7), (5, 1), (6, 2)):
        assert torch.equal(pool.k[:, dst].view(torch.uint8), k0[:, src].view(torch.uint8))
        assert torch.equal(pool.v[:, dst].view(torch.uint8), v0[:, src].view(torch.uint8))
    assert not pool.k[:, 3].view(torch.uint8).any(), "other pages are untouched"
    assert tier.write_backs == 3 == tier.load_backs
    assert tier.bytes_written == 3 * tier.host.page_bytes == tier.bytes_loaded
    assert tier.host.page_bytes == PagePool.bytes_per_page(3, 4, 2, 8, dtype)


def test_consecutive_page_ids_are_copied_as_runs():
    assert _runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs([]) == []
