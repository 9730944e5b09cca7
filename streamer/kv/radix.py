"""RadixCache: a radix tree over token ids that shares KV pages between requests.

Keys are cut at page granularity: an edge holds a whole number of pages, and
only full pages are ever cached. Each node owns one reference (PagePool
refcount) on the pages of its edge.

Contract with the scheduler:
  match_prefix(tokens) -> (pages, node): the longest cached run of full pages
      that prefixes `tokens`. The caller increfs the pages it keeps and must
      lock(node) while it uses them, then unlock(node).
  insert(tokens, pages, held_from) -> (num_cached, node): adopt the full pages of a
      sequence. Pages of the prefix that was already cached are not adopted
      (the caller keeps or drops its own copies); new edges take a reference.
      Every page on a path holds its KV: a sequence whose first held_from pages
      were released (sliding window) adds nothing unless the cached prefix
      covers them.
  evict(n): free up to n pages by dropping unlocked leaves, least recently
      used first. Locked nodes and their ancestors are never evicted.
  evictable: pages on unlocked nodes, kept up to date by every change, so that
      evict returns at once when there is nothing to drop (a full pool makes the
      scheduler ask for every request that needs a page, every step).
  salt: match_prefix, peek and insert take a namespace (a request's cache_salt). Prefixes
      are shared only within one: a tenant's hit never reveals another tenant's prompt.
      The unsalted namespace hangs from the root; each salt has a node of its own (no
      key, no pages) under the root, made by the first insert, dropped with its last
      child. Pages, locks and the LRU eviction stay global: one pool, one order.

  ┌ root ┐         lock_ref(node) = number of requests using node's path;
  │  A   │──┐      a locked node's ancestors are locked too (lock walks up).
  └──────┘  B ...
"""

from __future__ import annotations

import heapq
import itertools

from streamer.kv.pages import PagePool


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.root = Node((), [], None)
        self.root.lock_ref = 1  # never evicted
        self.spaces: dict[str, Node] = {}
        """Salt -> the node its namespace hangs from (a child of root, outside root.children)."""
        self._salts: dict[int, str] = {}
        """id(namespace node) -> its salt."""
        self._clock = itertools.count(1)
        self.cached_pages = 0
        self.evictable = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _first(self, key: tuple[int, ...] | list[int], i: int = 0) -> tuple[int, ...]:
        return tuple(key[i : i + self.page_size])

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], offset: int) -> int:
        ps = self.page_size
        n = 0
        for i in range(0, len(key), ps):
            if offset + i + ps > len(tokens) or tuple(tokens[offset + i : offset + i + ps]) != key[i : i + ps]:
                break
            n += 1
        return n

    def _split(self, node: Node, pages: int) -> Node:
        """Cut node's edge after `pages` pages; returns the new upper node."""
        ps = self.page_size
        assert node.parent is not None
        mid = Node(node.key[: pages * ps], node.pages[:pages], node.parent)
        mid.lock_ref = node.lock_ref
        mid.last_access = node.last_access
        node.parent.children[self._first(mid.key)] = mid
        node.key = node.key[pages * ps :]
        node.pages = node.pages[pages:]
        node.parent = mid
        mid.children[self._first(node.key)] = node
        return mid

    def _space(self, salt: str | None, make: bool = False) -> Node | None:
        """The node a namespace hangs from (None: that salt has nothing cached)."""
        if salt is None:
            return self.root
        node = self.spaces.get(salt)
        if node is None and make:
            node = self.spaces[salt] = Node((), [], self.root)
            self._salts[id(node)] = salt
        return node

    def _walk(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], Node]:
        space = self._space(salt)
        if space is None:
            return [], self.root  # (locking the root is what a miss does anyway)
        node, pages, offset = space, [], 0
        now = next(self._clock)
        usable = len(tokens) - len(tokens) % self.page_size
        while offset < usable:
            child = node.children.get(self._first(tokens, offset))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, offset)
            if n * self.page_size < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            offset += len(child.key)
            node = child
        return pages, node

    def peek(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], Node]:
        """match_prefix without counting it in the hit statistics (admission ordering)."""
        return self._walk(tokens, salt)

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], Node]:
        pages, node = self._walk(tokens, salt)
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(pages) * self.page_size
        return pages, node

    def insert(
        self, tokens: list[int], pages: list[int], salt: str | None = None, held_from: int = 0
    ) -> tuple[int, Node]:
        """Cache the full pages of `tokens` (whose KV is in `pages`) in the salt's namespace.

        pages[:held_from] no longer hold their KV (a sliding window released them): a path
        needs every page from the root, so only a cached prefix at least that long can be
        extended; otherwise nothing is adopted (the returned node is the match so far)."""
        full = min(len(tokens) // self.page_size, len(pages))
        tokens = tokens[: full * self.page_size]
        if full and held_from == 0:
            self._space(salt, make=True)
        cached, node = self._walk(tokens, salt)
        done = len(cached)
        if held_from <= done < full:
            new = Node(tuple(tokens[done * self.page_size :]), list(pages[done:full]), node)
            new.last_access = next(self._clock)
            node.children[self._first(new.key)] = new
            self.pool.incref(new.pages)
            self.cached_pages += len(new.pages)
            self.evictable += len(new.pages)
            node = new
        return done, node

    @staticmethod
    def path_pages(node: Node) -> int:
        """Pages on the path from the root to node: the length of the prefix it stands for."""
        n: Node | None = node
        total = 0
        while n is not None:
            total += len(n.pages)
            n = n.parent
        return total

    def lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            if n.lock_ref == 0:
                self.evictable -= len(n.pages)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            n.lock_ref -= 1
            assert n.lock_ref >= 0, "unlock without lock"
            if n.lock_ref == 0:
                self.evictable += len(n.pages)
                if n.parent is self.root and not n.key and not n.children:  # a namespace emptied meanwhile
                    self._drop_space(n)
            n = n.parent

    def evict(self, num_pages: int) -> int:
        """Drop LRU unlocked leaves until num_pages pages are free again; returns pages freed."""
        if self.evictable == 0:
            # (the walk below visits every node: with the pool full and every node locked, a
            # replay of W3 at 448 at once in bf16 KV spent 81% of its host time walking here)
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            before = self.pool.num_free
            self.pool.decref(leaf.pages)
            freed += self.pool.num_free - before
            self.cached_pages -= len(leaf.pages)
            self.evictable -= len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._first(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                if parent.key:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
                else:  # an emptied namespace: nothing to free, nothing to keep
                    self._drop_space(parent)
        return freed

    def _drop_space(self, node: Node) -> None:
        del self.spaces[self._salts.pop(id(node))]

    def check(self) -> None:
        """The counters match the nodes they count; namespace nodes hold no pages."""
        nodes = list(self._nodes())
        assert self.cached_pages == sum(len(n.pages) for n in nodes), "cached_pages is off"
        assert self.evictable == sum(len(n.pages) for n in nodes if n.lock_ref == 0), "evictable is off"
        spaces = self.spaces.values()
        assert all(n.parent is self.root and not n.key and not n.pages for n in spaces)
        assert all(n.children or n.lock_ref for n in spaces), "an empty namespace outlived its users"
        assert {id(n): s for s, n in self.spaces.items()} == self._salts, "namespace index is off"

    def reset(self) -> None:
        """Drop every unlocked node (used when prefix caching is turned off between runs)."""
        self.evict(self.pool.num_pages)

    def _nodes(self):
        stack = [*self.root.children.values(), *self.spaces.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _leaves(self):
        return (n for n in self._nodes() if not n.children)

    def held_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
