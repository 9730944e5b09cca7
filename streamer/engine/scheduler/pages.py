"""Pages: who holds which KV page, against one PagePool and its RadixCache.

A request holds a page table (`Request.pages`, one reference on each page) from admission
until it leaves; leaving, its full computed pages go to the tree, the rest to the free
list. A request can leave while a batch in flight still computes into its pages (a stop
string, an abort, a deadline, a failed step): its pages then wait for that batch.

Sliding window (`window` > 0: every layer attends to the last `window` tokens alone): a
query at position i sees keys j > i - window, and a request's next queries start at the
end of its last returned chunk, so the pages wholly before (that end - window + 1) are
read by nobody again. `trim` drops the request's references on them as each batch
returns and puts 0 (the scratch page) in their page-table entries; the kernels read no
entry wholly before the window of a call's queries. The batch still in flight (overlap)
starts its queries there too, so it reads none of them either.
With prefix caching a request trims nothing until its prompt is in the tree (later
arrivals share the prompt's pages), and the tree adopts a trimmed request's tokens only
where its cached prefix covers the released pages (every page on a path holds its KV).
A request that no longer holds any page of its locked prefix unlocks it: those pages
become evictable.

Invariants:
  - every page is free, held by a running request, or held by the radix tree (PagePool
    refcounts count the holders); also, until their batches are back, by a finished
    request (`zombies`) or one of a failed step (`retrying`); a request holds its pages
    after `released`, and its entries before it are 0;
  - a request holds a lock on the radix node of its cached prefix while it runs, until it
    has released every page of that prefix;
  - prefixes are claimed and cached within the request's cache_salt only;
  - pages are released only when no batch in flight holds them (the GPU may still be
    writing them); `trim` releases only pages that no batch in flight reads or writes.

Pages shares the scheduler's `running` list and `waiting` queue (the same objects) for the
moves between them that pages force: preempt, retry, requeue.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from streamer.engine.request import PLACEHOLDER, Request, Status
from streamer.engine.scheduler.keeps import Keeps
from streamer.kv.pages import PagePool
from streamer.kv.radix import Node, RadixCache

log = logging.getLogger("streamer.scheduler")


class Pages:
    def __init__(
        self,
        pool: PagePool,
        tree: RadixCache,
        prefix_caching: bool,
        running: list[Request],
        waiting: deque[Request],
        window: int = 0,
    ) -> None:
        self.pool = pool
        self.tree = tree
        self.prefix_caching = prefix_caching
        self.running = running
        self.waiting = waiting
        self.window = window
        """The model's KV window (model.windows.kv_window): 0 keeps every page."""
        self.zombies: dict[str, Request] = {}
        """Finished while in a batch in flight: pages are released when it returns."""
        self.retrying: dict[str, Request] = {}
        """Requests of a failed step, back to the queue once no batch in flight holds them."""
        self.keeps: Keeps | None = None
        """Where a leaving request with keep_prefix pins its path (keeps.py)."""

    def adopt(self, req: Request, pages: list[int], node: Node | None) -> None:
        """req starts from its cached prefix: `pages`, the path to `node`, which stays locked
        while req runs (None: no prefix caching)."""
        if node is not None:
            self.tree.lock(node)
        self.pool.incref(pages)
        req.pages, req.num_computed, req.node = list(pages), len(pages) * self.pool.page_size, node
        req.released = 0

    def claim(self, req: Request, cached_pages: int) -> int | None:
        """Identity of the first page req would compute (None: no full page to compute), in
        its cache namespace (requests of other salts do not wait for it: they cannot share)."""
        end = (cached_pages + 1) * self.pool.page_size
        if self.cacheable(req) < end:
            return None
        return hash((req.params.cache_salt, tuple(req.tokens[:end])))

    @staticmethod
    def cacheable(req: Request) -> int:
        """How many leading tokens may come from the cache: never the last one (its
        logits are needed), nor those whose prompt logprobs were asked for."""
        n = len(req.tokens) - 1
        start = req.params.prompt_logprobs_from
        if start is not None and not req.admitted_once:
            n = min(n, max(start - 1, 0))
        return n

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make req's page table cover num_tokens, evicting cached pages if needed."""
        need = self.pool.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if self.pool.num_free < need:
            self.tree.evict(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def cache_prompt(self, req: Request) -> None:
        """Share a freshly prefilled prompt with later arrivals (lock moves to the longer path)."""
        _, node = self.tree.insert(req.tokens[: req.prompt_len], req.pages, req.params.cache_salt, req.released)
        req.claim = None  # its prefix is in the tree now: waiting requests can share it
        self.tree.lock(node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node = node

    def release(self, req: Request) -> None:
        """Give back req's pages: full computed pages to the tree, the rest to the pool."""
        known = len(req.tokens)
        while known and req.tokens[known - 1] == PLACEHOLDER:  # sampled by a batch that was dropped
            known -= 1
        computed = min(req.num_computed, known)
        if self.prefix_caching and computed:
            _, node = self.tree.insert(req.tokens[:computed], req.pages, req.params.cache_salt, req.released)
            if self.keeps is not None:
                self.keeps.keep(req, node)
        self.pool.decref(req.pages[req.released :])
        if req.node is not None:
            self.tree.unlock(req.node)
        req.pages, req.node, req.num_computed, req.released = [], None, 0, 0

    def trim(self, req: Request, next_query: int) -> None:
        """Sliding window: release req's pages wholly before the window of next_query, the
        lowest position that any of its queries still to run (in flight or not) will have."""
        dead = min((next_query - self.window + 1) // self.pool.page_size, len(req.pages))
        if dead <= req.released:
            return
        if self.prefix_caching and not self._prompt_cached(req):
            return  # the prompt's pages go to the tree first
        self.pool.decref(req.pages[req.released : dead])
        req.pages[req.released : dead] = [0] * (dead - req.released)
        req.released = dead
        if req.node is not None and dead >= self.tree.path_pages(req.node):
            self.tree.unlock(req.node)  # it holds none of those pages now: they may be evicted
            req.node = None

    @staticmethod
    def _prompt_cached(req: Request) -> bool:
        """Its first sampled token is back, so cache_prompt has run (a resumed request's ran
        before its preemption, and does not run again: nothing to wait for)."""
        return req.num_output > 0 and req.tokens[req.prompt_len] != PLACEHOLDER

    def leave(self, req: Request, in_flight: Counter[str]) -> None:
        """A running request ends: its pages now, or once its batches in flight are back."""
        if req.request_id in in_flight:
            self.zombies[req.request_id] = req  # the GPU may still write its pages
        else:
            self.release(req)

    def preempt(self, req: Request) -> None:
        """Recompute later: pages go to the tree, so the resume is mostly a cache hit."""
        log.debug("preempt %s at %d tokens", req.request_id, req.num_computed)
        self.running.remove(req)
        self.release(req)
        req.status = Status.WAITING
        req.preemptions += 1
        if req.grammar is not None:
            # the matcher has accepted exactly the output tokens, which a preemption keeps
            assert req.grammar.num_accepted == req.num_output, "grammar state out of step with tokens"
        self.waiting.appendleft(req)

    def retry_later(self, req: Request, valid: int) -> None:
        """Take req out of a failed step: only tokens[:valid] have trustworthy KV (the failed
        chunk started there; batches after it built on its output). Back to the queue once
        no batch in flight holds its pages."""
        self.running.remove(req)
        req.status = Status.WAITING
        req.suspect = True
        req.num_computed = min(req.num_computed, valid)
        self.retrying[req.request_id] = req

    def returned(self, in_flight: Counter[str]) -> None:
        """A batch is back: release the zombies and requeue the retrying requests that no
        batch in flight holds any more."""
        for rid in [r for r in self.zombies if r not in in_flight]:
            self.release(self.zombies.pop(rid))
        for rid in [r for r in self.retrying if r not in in_flight]:
            self._requeue(self.retrying.pop(rid))

    def _requeue(self, req: Request) -> None:
        self.release(req)  # the valid prefix goes to the tree: the retry mostly hits it
        if req.status == Status.FINISHED:  # aborted while its batches drained
            return
        while len(req.tokens) > req.prompt_len and req.tokens[-1] == PLACEHOLDER:
            req.tokens.pop()  # sampled by the failed step or a batch after it
        self.waiting.appendleft(req)

    def check(self) -> None:
        """Every page is free, held by the tree, or held by a running request (or a finished
        or retrying one whose batch is still in flight); the refcounts say exactly that."""
        self.pool.check()
        self.tree.check()
        expect = [0] * self.pool.num_pages
        expect[0] = 1
        for p in self.tree.held_pages():
            expect[p] += 1
        for r in [*self.running, *self.zombies.values(), *self.retrying.values()]:
            assert not any(r.pages[: r.released]), f"{r.request_id}: a released page-table entry is not 0"
            assert all(r.pages[r.released :]), f"{r.request_id}: holds the scratch page"
            if r.released:
                assert self.window, "pages released without a sliding window"
                assert r.node is None or r.released < self.tree.path_pages(r.node), "locks a prefix it released"
            for p in r.pages[r.released :]:
                expect[p] += 1
        assert expect == self.pool.refcount, "page refcounts do not match their holders"
