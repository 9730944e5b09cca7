"""Loads: a waiting request's cached prefix comes back from the host tier (kv/host.py).

Before a request is matched for admission, the part of its prefix that lies on the host
(RadixCache.host_path) is copied into fresh device pages, which the tree's nodes take at
once (those nodes are then on the device and the host). On CPU the copy is done when
`prefetch` returns; on CUDA it runs on the tier's copy stream, and the request waits in
the queue (others are admitted and run) until the copy's event has completed; then it is
matched like any other request, and its whole prefix is a device hit.

Invariants:
  - while a copy is in flight its target node (and so its whole path) is locked, so
    neither its device pages (being written) nor its host pages (being read) can go;
    the lock is held until the event has completed, even if the request leaves meanwhile
    (abort, timeout: the load becomes an orphan, unlocked by `poll` once done);
  - a node whose copy is in flight is not `ready`: a second request that matches it waits
    for the same copy (an event recorded after it), it never reads the pages early;
  - loads take device pages through the tree's eviction like any allocation: when the
    pool cannot hold the whole host part, the leading nodes that fit are loaded and the
    rest of the prompt is computed; loads in flight hold at most half the pool (more
    requests wait for theirs to start).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from streamer.config import EngineConfig
from streamer.engine.request import Request
from streamer.kv.host import HostTier
from streamer.kv.pages import PagePool
from streamer.kv.radix import Node, RadixCache

POLL_S = 0.0005
"""How soon the scheduler looks again at a copy in flight when nothing else wakes it."""


@dataclass(slots=True)
class Load:
    event: Any
    """The copy's CUDA event (done once it has completed)."""
    node: Node
    """Locked until the event has completed."""
    tokens: int
    """Prompt tokens the request gets from the host through this load."""
    pages: int = 0
    """Device pages this load filled."""


class Loads:
    def __init__(self, pool: PagePool, tree: RadixCache) -> None:
        self.pool = pool
        self.tree = tree
        self.pending: dict[str, Load] = {}
        """request id -> its load in flight."""
        self.orphans: list[Load] = []
        """Loads whose request left before the copy completed."""
        self.host_tokens: dict[str, int] = {}
        """request id -> tokens of its prefix that came from the host (until admitted)."""

    @property
    def active(self) -> bool:
        return self.tree.tier is not None

    def prefetch(self, req: Request, tokens: list[int]) -> bool:
        """Bring the host part of tokens' cached prefix to the device for req. True: match
        now; False: a copy is in flight, ask again later."""
        tier = self.tree.tier
        if tier is None:
            return True
        rid = req.request_id
        load = self.pending.get(rid)
        if load is not None:
            if not tier.done(load.event):
                return False
            del self.pending[rid]
            self.tree.unlock(load.node)
            self.host_tokens[rid] = self.host_tokens.get(rid, 0) + load.tokens
            return True
        path = self.tree.host_path(tokens, req.params.cache_salt)
        if not path:
            return True
        self.tree.lock(path[-1])  # (eviction below must leave this path alone)
        busy = [n for n in path if n.pages]  # being loaded by another request's copy
        todo = path[len(busy) :]
        want = sum(len(n.key) for n in todo) // self.pool.page_size
        if self.pending and sum(ld.pages for ld in self.pending.values()) + want > self.pool.capacity // 2:
            # loads lock their pages until their requests are admitted: that many at once would
            # leave the running requests nothing to evict (they would preempt each other)
            self.tree.unlock(path[-1])
            return False
        if self.pool.num_free < want:
            self.tree.evict(want - self.pool.num_free)
        take: list[Node] = []
        room = self.pool.num_free
        for n in todo:
            k = len(n.key) // self.pool.page_size
            if k > room:
                break
            take.append(n)
            room -= k
        reach = busy + take
        if not reach:
            self.tree.unlock(path[-1])
            return True
        self.tree.lock(reach[-1])
        self.tree.unlock(path[-1])
        host = [p for n in take for p in (n.host or [])]
        gpu = self.pool.alloc(len(host))
        assert gpu is not None  # (room was counted above)
        event = tier.load(host, gpu) if host else tier.marker()
        i = 0
        for n in take:
            k = len(n.key) // self.pool.page_size
            self.tree._set_pages(n, gpu[i : i + k])
            n.loading = event
            i += k
        tokens_back = sum(len(n.key) for n in reach)
        tier.hit_tokens += tokens_back
        if tier.done(event):
            self.tree.unlock(reach[-1])
            self.host_tokens[rid] = self.host_tokens.get(rid, 0) + tokens_back
            return True
        self.pending[rid] = Load(event, reach[-1], tokens_back, len(gpu))
        return False

    def admitted(self, req: Request) -> int:
        """req is admitted: the tokens of its prefix that came from the host."""
        return self.host_tokens.pop(req.request_id, 0)

    def forget(self, req: Request) -> None:
        """req leaves while waiting: a load in flight finishes on its own (then unlocks)."""
        self.host_tokens.pop(req.request_id, None)
        load = self.pending.pop(req.request_id, None)
        if load is not None:
            self.orphans.append(load)
            self.poll()

    def poll(self) -> None:
        """Unlock the orphans whose copies have completed."""
        tier = self.tree.tier
        if tier is None:
            return
        keep = []
        for load in self.orphans:
            if tier.done(load.event):
                self.tree.unlock(load.node)
            else:
                keep.append(load)
        self.orphans = keep

    def wake(self) -> float | None:
        """When the scheduler should look again at copies in flight (None: none)."""
        return time.monotonic() + POLL_S if self.pending or self.orphans else None


def host_tier(config: EngineConfig, pool: PagePool) -> HostTier | None:
    """The host tier of --host-kv-cache-gb (None: off)."""
    return HostTier.of_size(pool, config.host_kv_cache_gb)


def check_holds(tree: RadixCache, locks: list[Node], pins: list[Node]) -> None:
    """Every node's lock_ref and pin count exactly the holders that walk through it: `locks`
    (the nodes locked by requests and loads) and `pins` (kept prefixes)."""
    want_lock: dict[int, int] = {}
    want_pin: dict[int, int] = {}
    for held, want in ((locks, want_lock), (pins, want_pin)):
        for node in held:
            n: Node | None = node
            while n is not None:
                want[id(n)] = want.get(id(n), 0) + 1
                n = n.parent
    for n in [tree.root, *tree._nodes()]:
        assert n.lock_ref == want_lock.get(id(n), 0) + (n is tree.root), "a lock without its holder"
        assert n.pin == want_pin.get(id(n), 0), "a pin without its holder"
