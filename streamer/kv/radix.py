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

  host tier (tier: a kv.host.HostTier, --host-kv-cache-gb): a node's pages live on the
      device (`pages`), in host memory (`host`), or both. Device residency is closed under
      prefixes (a device node's parent is on the device), so evict still drops device
      leaves; with a tier, a device leaf is written back to the host (or just loses its
      device pages if it has a host copy) and stays in the tree, and evict_host drops host
      copies in LRU order (host-only leaves first leave the tree). match_prefix and peek
      return the device-ready prefix; host_path tells what lies beyond it on the host.
      `loading` marks a node whose device pages are still being copied in (not ready).
      `pin` (pin/unpin, walking up like lock) keeps a path in the tree, on the device or
      the host: evict_host skips pinned nodes (a WebSocket session's history).

  ┌ root ┐         lock_ref(node) = number of requests using node's path;
  │  A   │──┐      a locked node's ancestors are locked too (lock walks up).
  └──────┘  B ...
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from streamer.kv.node import Node
from streamer.kv.pages import PagePool

__all__ = ["Node", "RadixCache"]


class RadixCache:
    def __init__(self, pool: PagePool, tier: Any = None) -> None:
        self.pool = pool
        self.tier = tier
        """A kv.host.HostTier, or None (evicted pages are dropped)."""
        self.host_pages = 0
        """Host pages held by nodes."""
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
        mid.lock_ref, mid.pin, mid.loading = node.lock_ref, node.pin, node.loading
        mid.last_access = node.last_access
        node.parent.children[self._first(mid.key)] = mid
        node.key = node.key[pages * ps :]
        node.pages = node.pages[pages:]
        if node.host is not None:
            mid.host, node.host = node.host[:pages], node.host[pages:]
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

    def _path(self, tokens: list[int], salt: str | None = None) -> tuple[Node, list[Node]]:
        """The namespace node and the nodes (on the device or the host) that prefix tokens."""
        space = self._space(salt)
        if space is None:
            return self.root, []  # (locking the root is what a miss does anyway)
        node, path, offset = space, [], 0
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
            path.append(child)
            offset += len(child.key)
            node = child
        return space, path

    def _walk(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], Node]:
        node, path = self._path(tokens, salt)
        pages: list[int] = []
        for n in path:
            if not n.ready:
                break
            pages.extend(n.pages)
            node = n
        return pages, node

    def host_path(self, tokens: list[int], salt: str | None = None) -> list[Node]:
        """The nodes past the device-ready prefix of tokens: on the host (or being loaded)."""
        _, path = self._path(tokens, salt)
        i = next((i for i, n in enumerate(path) if not n.ready), len(path))
        return path[i:]

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
        node, path = self._path(tokens, salt)
        done = 0
        for n in path:
            k = len(n.key) // self.page_size
            if not n.pages:  # on the host only: this sequence's own pages hold its KV now
                if done < held_from:
                    return done, node  # (they are released: the path stays on the host)
                self._set_pages(n, list(pages[done : done + k]))
                self.pool.incref(n.pages)
            done += k
            node = n
        if held_from <= done < full:
            new = Node(tuple(tokens[done * self.page_size :]), list(pages[done:full]), node)
            new.last_access = next(self._clock)
            node.children[self._first(new.key)] = new
            self.pool.incref(new.pages)
            self.cached_pages += len(new.pages)
            self.evictable += len(new.pages)
            node = new
        return done, node

    def path_pages(self, node: Node) -> int:
        """Pages on the path from the root to node: the length of the prefix it stands for."""
        n: Node | None = node
        total = 0
        while n is not None:
            total += len(n.key)
            n = n.parent
        return total // self.page_size

    def _set_pages(self, n: Node, pages: list[int]) -> None:
        """n's device pages become `pages` (the counters follow)."""
        delta = len(pages) - len(n.pages)
        n.pages = pages
        self.cached_pages += delta
        if n.lock_ref == 0:
            self.evictable += delta

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

    def pin(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            n.pin += 1
            n = n.parent

    def unpin(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            n.pin -= 1
            assert n.pin >= 0, "unpin without pin"
            n = n.parent

    @staticmethod
    def _device_leaf(n: Node) -> bool:
        """On the device, unlocked, and no child on the device: evict may take its pages."""
        return bool(n.pages) and n.lock_ref == 0 and not any(c.pages for c in n.children.values())

    def evict(self, num_pages: int, write_back: bool = True) -> int:
        """Free device pages of LRU unlocked leaves (of the device part of the tree) until
        num_pages pages are free again; returns pages freed. Without a host tier the leaves
        leave the tree; with one they go to the host (kv/host.py) and stay."""
        if self.evictable == 0:
            # (the walk below visits every node: with the pool full and every node locked, a
            # replay of W3 at 448 at once in bf16 KV spent 81% of its host time walking here)
            return 0
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            before = self.pool.num_free
            parent = leaf.parent
            assert parent is not None
            if self.tier is not None and write_back and (leaf.host is not None or self._back_up(leaf)):
                self.pool.decref(leaf.pages)
                self._set_pages(leaf, [])
            else:
                self._drop(leaf)
            freed += self.pool.num_free - before
            if parent.key and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _back_up(self, node: Node) -> bool:
        """Write node's device pages back to new host pages (False: no room on the host)."""
        assert self.tier is not None and node.host is None and node.loading is None
        n = len(node.pages)
        host = self.tier.host
        if host.num_free < n:
            self.evict_host(n - host.num_free)
        pages = host.alloc(n)
        if pages is None:
            return False
        self.tier.write(node.pages, pages)
        node.host = pages
        self.host_pages += n
        return True

    def _drop(self, node: Node) -> None:
        """node and everything under it leave the tree (unlocked, so are its descendants)."""
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.lock_ref == 0, "dropping a locked node"
            stack.extend(n.children.values())
            if n.pages:
                self.pool.decref(n.pages)
                self._set_pages(n, [])
            self._drop_host(n)
        parent = node.parent
        assert parent is not None
        del parent.children[self._first(node.key)]
        if parent is not self.root and not parent.key and not parent.children and parent.lock_ref == 0:
            self._drop_space(parent)  # an emptied namespace: nothing to free, nothing to keep

    def _drop_host(self, n: Node) -> None:
        if n.host is not None:
            assert self.tier is not None
            self.tier.host.free(n.host)
            self.host_pages -= len(n.host)
            n.host = None

    def evict_host(self, num_pages: int) -> int:
        """Free host pages in LRU order: host copies of device nodes, and host-only leaves
        (which leave the tree). Locked and pinned nodes keep theirs. Returns pages freed."""
        if self.tier is None or not self.host_pages:
            return 0

        def droppable(n: Node) -> bool:
            return n.host is not None and n.lock_ref == 0 and n.pin == 0 and (bool(n.pages) or not n.children)

        heap = [(n.last_access, id(n), n) for n in self._nodes() if droppable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, n = heapq.heappop(heap)
            assert n.host is not None
            freed += len(n.host)
            parent = n.parent
            assert parent is not None
            if n.pages:
                self._drop_host(n)
            else:
                self._drop(n)
                if parent.key and droppable(parent):
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
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
        assert self.host_pages == sum(len(n.host) for n in nodes if n.host is not None), "host_pages is off"
        for n in nodes:
            assert n.pages or n.host is not None or not n.key, "a node holds its KV nowhere"
            assert n.host is None or len(n.host) * self.page_size == len(n.key), "host pages do not cover the edge"
            assert not n.pages or len(n.pages) * self.page_size == len(n.key), "pages do not cover the edge"
            assert not n.pages or n.parent is None or not n.parent.key or n.parent.pages, "device part not prefix-closed"
        if self.tier is not None:
            self.tier.host.check(self.host_held())

    def reset(self) -> None:
        """Drop every unlocked node (used when prefix caching is turned off between runs)."""
        self.evict(self.pool.num_pages, write_back=False)
        self.evict_host(self.host_pages)

    def _nodes(self):
        stack = [*self.root.children.values(), *self.spaces.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def held_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def host_held(self) -> list[int]:
        return [p for n in self._nodes() if n.host is not None for p in n.host]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
