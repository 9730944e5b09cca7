"""RadixCache: page-granular prefix sharing with locks and LRU eviction."""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.kv.pages import PagePool
from streamer.kv.radix import RadixCache

PS = 4


def setup(n=64):
    pool = PagePool(1, n, PS, 1, 2, torch.float32, "cpu")
    return pool, RadixCache(pool)


def cache_sequence(pool, tree, tokens, salt=None):
    """What a finishing request does: allocate, insert, drop its own references."""
    pages = pool.alloc(pool.pages_for(len(tokens)))
    tree.insert(tokens, pages, salt)
    pool.decref(pages)
    return pages


def test_match_returns_only_full_pages_of_the_longest_prefix():
    pool, tree = setup()
    pages = cache_sequence(pool, tree, list(range(10)))  # 2 full pages + 2 tokens
    got, _ = tree.match_prefix(list(range(9)) + [99])
    assert got == pages[:2]
    got, _ = tree.match_prefix([0, 1, 2, 3, 4, 5, 6, 99])
    assert got == pages[:1], "a partial page never matches"


def test_insert_shares_the_existing_prefix_and_splits_edges():
    pool, tree = setup()
    a = cache_sequence(pool, tree, list(range(12)))
    b_tokens = list(range(8)) + [50, 51, 52, 53]
    b = pool.alloc(3)
    done, _ = tree.insert(b_tokens, b)
    pool.decref(b)
    assert done == 2
    assert tree.match_prefix(b_tokens)[0] == a[:2] + b[2:]
    assert pool.refcount[b[0]] == 0, "duplicate pages of the cached prefix are not adopted"


def test_locked_paths_survive_eviction_and_lru_goes_first():
    pool, tree = setup()
    old = cache_sequence(pool, tree, [1] * 8)
    new = cache_sequence(pool, tree, [2] * 8)
    pages, node = tree.match_prefix([2] * 8 + [0])
    tree.lock(node)
    assert tree.evict(100) == 2
    assert all(pool.refcount[p] == 0 for p in old)
    assert all(pool.refcount[p] == 1 for p in new)
    tree.unlock(node)
    assert tree.evict(100) == 2
    assert pool.num_free == pool.capacity


def test_eviction_order_is_least_recently_used():
    pool, tree = setup()
    a = cache_sequence(pool, tree, [1] * 4)
    b = cache_sequence(pool, tree, [2] * 4)
    tree.match_prefix([1] * 4)  # touch a
    tree.evict(1)
    assert pool.refcount[b[0]] == 0 and pool.refcount[a[0]] == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1, max_size=25), st.integers(0, 99),
       st.sampled_from([(None,), (None, "a", "b")]))
def test_random_traffic_keeps_refcounts_equal_to_holders(seqs, seed, salts):
    pool, tree = setup(32)
    rng = random.Random(seed)
    live = []  # (tokens, pages, node, salt) held by "running requests"
    for tokens in seqs:
        salt = rng.choice(salts)
        pages, node = tree.match_prefix(tokens, salt)
        tree.lock(node)
        pool.incref(pages)
        extra = pool.pages_for(len(tokens)) - len(pages)
        if pool.num_free < extra:
            tree.evict(extra - pool.num_free)
        new = pool.alloc(extra)
        if new is None:
            pool.decref(pages)
            tree.unlock(node)
            continue
        live.append((tokens, pages + new, node, salt))
        if rng.random() < 0.5:
            t, p, n, s = live.pop(rng.randrange(len(live)))
            tree.insert(t, p, s)
            pool.decref(p)
            tree.unlock(n)
        expect = [0] * pool.num_pages
        expect[0] = 1
        for p in tree.held_pages():
            expect[p] += 1
        for _, ps, _, _ in live:
            for p in ps:
                expect[p] += 1
        assert expect == pool.refcount
        pool.check()
        tree.check()
    for t, p, n, s in live:
        tree.insert(t, p, s)
        pool.decref(p)
        tree.unlock(n)
    tree.check()
    tree.evict(pool.num_pages)
    assert pool.num_free == pool.capacity
    assert tree.evictable == 0 == tree.cached_pages
    assert not tree.spaces, "a namespace goes with its last page"


def test_evictable_pages_follow_locks_splits_and_evictions():
    pool, tree = setup()
    cache_sequence(pool, tree, list(range(12)))  # 3 pages, one edge
    assert tree.evictable == 3
    _, node = tree.match_prefix(list(range(8)) + [99] * 4)  # splits the edge after 2 pages
    tree.lock(node)
    assert tree.evictable == 1, "the locked path's 2 pages cannot be dropped"
    tree.check()
    assert tree.evict(100) == 1 and tree.evictable == 0
    assert tree.evict(100) == 0, "nothing unlocked: nothing to walk"
    tree.unlock(node)
    assert tree.evictable == 2
    tree.check()


def test_eviction_with_every_node_locked_does_not_walk_the_tree(monkeypatch):
    """A full pool makes the scheduler call evict for every request that needs a page, every
    step: with nothing evictable that must cost nothing, whatever the tree's size."""
    pool, tree = setup(64)
    for i in range(8):  # eight running requests, each holding its one cached page
        _, node = tree.insert([i] * 4, pool.alloc(1))
        tree.lock(node)
    assert tree.evictable == 0
    monkeypatch.setattr(tree, "_nodes", lambda: (_ for _ in ()).throw(AssertionError("walked the tree")))
    assert tree.evict(5) == 0


def test_salts_are_namespaces_that_share_nothing():
    """A tenant's prompt in the cache must not show in another tenant's cached_tokens: prefixes
    are shared within one salt only (None, unsalted, is a namespace of its own)."""
    pool, tree = setup()
    prompt = list(range(12))
    alice = cache_sequence(pool, tree, prompt, "alice")
    assert tree.match_prefix(prompt)[0] == [], "unsalted requests do not see a salted prompt"
    assert tree.match_prefix(prompt, "bob")[0] == []
    assert tree.match_prefix(prompt, "alice")[0] == alice
    plain = cache_sequence(pool, tree, prompt)
    assert tree.match_prefix(prompt)[0] == plain and set(plain).isdisjoint(alice)
    assert tree.match_prefix(prompt, "alice")[0] == alice
    _, node = tree.match_prefix(prompt, "nobody")
    assert node is tree.root and "nobody" not in tree.spaces, "a miss makes no namespace"
    tree.check()


def test_one_lru_order_across_namespaces_and_emptied_namespaces_go():
    pool, tree = setup()
    a = cache_sequence(pool, tree, [1] * 4, "a")
    b = cache_sequence(pool, tree, [1] * 4, "b")
    plain = cache_sequence(pool, tree, [1] * 4)
    tree.match_prefix([1] * 4, "a")  # touch a: b is now the least recently used
    assert tree.evict(1) == 1
    assert pool.refcount[b[0]] == 0 and pool.refcount[a[0]] == 1 == pool.refcount[plain[0]]
    assert set(tree.spaces) == {"a"}
    # a request holds namespace c's (uncached) root while c's only page is evicted
    cache_sequence(pool, tree, [2] * 4, "c")
    _, node = tree.match_prefix([3] * 8, "c")
    tree.lock(node)
    tree.evict(pool.capacity)
    assert "c" in tree.spaces and not tree.spaces["c"].children
    tree.check()
    tree.unlock(node)
    assert "c" not in tree.spaces
    tree.check()
    assert pool.num_free == pool.capacity


def test_a_sequence_with_released_pages_extends_only_a_prefix_that_covers_them():
    """Sliding window: pages[:held_from] lost their KV. Every page of a path must hold its
    KV, so such a sequence adds nothing unless the cached prefix covers the released pages."""
    pool, tree = setup()
    prompt = cache_sequence(pool, tree, list(range(8)))  # 2 pages cached
    tokens = list(range(20))  # the prompt, then 3 pages of its own
    own = pool.alloc(5)
    done, node = tree.insert(tokens, [0, 0, 0] + own[3:], held_from=3)
    assert done == 2 and tree.match_prefix(tokens)[0] == prompt, "a hole at page 2: nothing added"
    assert tree.path_pages(node) == 2
    done, node = tree.insert(tokens, [0, 0] + own[2:], held_from=2)
    assert done == 2 and tree.match_prefix(tokens)[0] == prompt + own[2:]
    assert tree.path_pages(node) == 5
    done, _ = tree.insert(list(range(100, 108)), own[:2], "tenant", held_from=1)
    assert done == 0 and not tree.spaces, "no namespace is made for a sequence it cannot hold"
    pool.decref(own)
    tree.check()
    pool.check()
