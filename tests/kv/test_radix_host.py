"""RadixCache with a host tier: evicted device pages go to the host, come back on a match."""

from types import SimpleNamespace

import torch

from streamer.engine.scheduler.loads import Loads
from streamer.kv.host import HostTier
from streamer.kv.pages import PagePool
from streamer.kv.radix import RadixCache

PS = 4


def setup(device_pages=9, host_pages=16):
    pool = PagePool(1, device_pages, PS, 1, 2, torch.float32, "cpu")
    tier = HostTier(pool, host_pages * PagePool.bytes_per_page(1, PS, 1, 2, torch.float32))
    return pool, RadixCache(pool, tier)


def cache_sequence(pool, tree, tokens, fill=None):
    """A finishing request: pages (with KV `fill`), insert, drop its own references."""
    pages = pool.alloc(pool.pages_for(len(tokens)))
    assert pages is not None
    for i, p in enumerate(pages):
        pool.k[:, p] = (fill if fill is not None else tokens[0]) * 100 + i
    tree.insert(tokens, pages)
    pool.decref(pages)
    return pages


def req(rid="r", salt=None):
    return SimpleNamespace(request_id=rid, params=SimpleNamespace(cache_salt=salt))


def test_eviction_writes_pages_back_and_the_node_stays_in_the_tree():
    pool, tree = setup()
    cache_sequence(pool, tree, list(range(8)))  # 2 pages
    assert tree.evict(2) == 2 and pool.num_free == pool.capacity
    assert tree.cached_pages == 0 and tree.host_pages == 2 and tree.tier.write_backs == 2
    got, _ = tree.match_prefix(list(range(9)))
    assert got == [], "host pages are not a device hit"
    assert [len(n.key) for n in tree.host_path(list(range(9)))] == [8]
    tree.check()


def test_a_load_back_restores_the_kv_into_fresh_device_pages():
    pool, tree = setup()
    tokens = list(range(12))
    cache_sequence(pool, tree, tokens, fill=7)
    tree.evict(3)
    loads = Loads(pool, tree)
    assert loads.prefetch(req(), tokens + [99]), "on CPU the copy is done at once"
    got, node = tree.match_prefix(tokens + [99])
    assert len(got) == 3
    assert [pool.k[0, p, 0, 0, 0].item() for p in got] == [700, 701, 702]
    assert loads.admitted(req()) == 12
    assert node.host is not None, "it is on both tiers now: a second eviction copies nothing"
    tree.evict(3)
    assert tree.tier.write_backs == 3 and tree.host_pages == 3
    tree.check()


def test_the_device_part_stays_a_prefix_so_a_parent_goes_after_its_children():
    pool, tree = setup()
    cache_sequence(pool, tree, list(range(8)))
    cache_sequence(pool, tree, list(range(4)) + [50, 51, 52, 53])  # splits: [0..3] -> two children
    tree.check()
    tree.evict(1)
    for n in tree._nodes():
        assert not n.pages or all(not c.pages for c in n.children.values()) or n.children
    tree.check()
    tree.evict(10)
    assert tree.cached_pages == 0 and tree.host_pages == 3
    tree.check()


def test_the_host_lru_drops_host_only_leaves_first_and_keeps_pinned_paths():
    pool, tree = setup(device_pages=9, host_pages=4)
    cache_sequence(pool, tree, [1] * 8)
    tree.evict(2)
    cache_sequence(pool, tree, [2] * 8)
    _, node = tree.match_prefix([2] * 8)
    tree.pin(node)
    tree.evict(2)
    assert tree.host_pages == 4
    cache_sequence(pool, tree, [3] * 8)
    tree.evict(2)  # the host is full: the oldest unpinned host-only leaf ([1]*8) goes
    assert tree.host_path([1] * 8) == []
    assert tree.host_path([2] * 8) and tree.host_path([3] * 8)
    tree.check()
    cache_sequence(pool, tree, [4] * 8)
    tree.evict(2)  # [3]*8 goes (LRU, unpinned); the pinned [2]*8 stays
    assert tree.host_path([2] * 8) and not tree.host_path([3] * 8) and tree.host_path([4] * 8)
    tree.unpin(node)
    tree.check()


def test_with_no_host_room_eviction_drops_the_node_and_its_host_subtree():
    pool, tree = setup(device_pages=9, host_pages=2)
    cache_sequence(pool, tree, list(range(8)))
    _, n = tree.match_prefix(list(range(8)))
    tree.pin(n)
    tree.evict(2)  # pinned on the host
    cache_sequence(pool, tree, [5] * 8)
    tree.evict(2)  # no room for it: it is dropped, as without a tier
    assert tree.host_path([5] * 8) == [] and tree.match_prefix([5] * 8)[0] == []
    assert pool.num_free == pool.capacity
    tree.unpin(n)
    tree.check()


def test_a_recomputed_host_prefix_takes_the_requests_pages_on_insert():
    pool, tree = setup()
    cache_sequence(pool, tree, list(range(8)))
    tree.evict(2)
    pages = cache_sequence(pool, tree, list(range(12)))  # recomputed all 3 pages
    got, _ = tree.match_prefix(list(range(12)) + [1])
    assert got == pages, "the host-only node took the request's device pages"
    assert tree.host_pages == 2
    tree.check()


def test_reset_drops_both_tiers():
    pool, tree = setup()
    cache_sequence(pool, tree, list(range(8)))
    tree.evict(1)
    cache_sequence(pool, tree, [9] * 8)
    tree.reset()
    assert tree.cached_pages == 0 == tree.host_pages and pool.num_free == pool.capacity
    assert tree.tier.host.num_free == tree.tier.host.num_pages
    tree.check()
