"""PagePool: fixed-size pages handed out from a free list, counted by holders."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.kv.pages import PagePool


def pool(n=9, page_size=4):
    return PagePool(num_layers=2, num_pages=n, page_size=page_size, kv_heads=1, head_dim=4,
                    dtype=torch.float32, device="cpu")


def test_kv_tensors_have_the_paged_shape():
    p = pool()
    assert p.k.shape == (2, 9, 4, 1, 4) and p.v.shape == p.k.shape
    assert p.k.is_contiguous() and p.v.is_contiguous()


def test_float8_pool_keeps_v_token_major_and_k_head_major():
    """Same shape, but each page's tokens of one (head, dim) of V are adjacent bytes, and
    each page's keys of one head are adjacent rows."""
    p = PagePool(num_layers=2, num_pages=3, page_size=16, kv_heads=2, head_dim=8,
                 dtype=torch.float8_e4m3fn, device="cpu")
    assert p.v.shape == p.k.shape == (2, 3, 16, 2, 8)
    assert p.v.stride()[2:] == (1, 8 * 16, 16)
    assert p.k.stride()[2:] == (8, 16 * 8, 1)


def test_page_zero_is_reserved_scratch():
    p = pool()
    assert p.capacity == 8 and p.num_free == 8
    assert 0 not in p.alloc(8)


def test_alloc_is_all_or_nothing():
    p = pool()
    assert p.alloc(9) is None and p.num_free == 8
    got = p.alloc(3)
    assert len(got) == 3 and p.num_free == 5


def test_page_returns_to_free_list_when_last_holder_lets_go():
    p = pool()
    [a] = p.alloc(1)
    p.incref([a])
    p.decref([a])
    assert p.num_free == 7
    p.decref([a])
    assert p.num_free == 8
    p.check()


def test_pages_for_rounds_up():
    p = pool(page_size=16)
    assert [p.pages_for(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(1, 4)), max_size=40))
def test_free_list_is_exactly_the_unreferenced_pages(ops):
    p = pool()
    held: list[int] = []
    for op, n in ops:
        if op == "alloc":
            got = p.alloc(n)
            if got is not None:
                held += got
        elif op == "incref" and held:
            p.incref(held[:n])
            held += held[:n]
        elif op == "decref" and held:
            p.decref(held[:n])
            del held[:n]
        p.check()
    p.decref(held)
    assert p.num_free == p.capacity
