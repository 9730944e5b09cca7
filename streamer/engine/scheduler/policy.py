"""Scheduler: the request sets, and what runs next. Synchronous and deterministic: the
actor loop (actor.py) feeds it messages; tests drive it with fake step outputs.

One step (schedule): running requests first, each with as much of its remaining KV as
the token budget allows (a decode is one token); a request that cannot grow preempts
the newest running one (pages.py). Then waiting requests are admitted under what is
left of the budget, in cache-aware order: the longest cached prefix first (stable, so
FCFS among equals), plain FCFS once the queue is longer than fcfs_queue_threshold.
With scheduling_policy priority, lower SamplingParams.priority goes first in both (the
orders above among equals), and preemption takes the running request last by
(priority, arrival).

Invariants:
  - prefixes are matched and claimed within the request's cache_salt only; a request
    whose first page to compute another running request is computing on the same prefix
    waits for it to reach the tree (`claim`) rather than compute it twice;
  - a batch built ahead (a batch still in flight, overlap) never preempts (the pages may
    be in use), and its tokens to come are PLACEHOLDERs that the runner reads on the device;
  - a request suspected of failing a step (Request.suspect) runs its next step alone.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

import numpy as np

from streamer.config import EngineConfig
from streamer.diagnostics import Diagnostics
from streamer.engine.adapters import lora_key, unloaded
from streamer.engine.request import Request, Status
from streamer.engine.scheduler import results
from streamer.engine.scheduler.batch import BatchBuilder
from streamer.engine.scheduler.clock import AheadClock
from streamer.engine.scheduler.deadlines import Deadlines, timed_out
from streamer.engine.scheduler.keeps import Keeps
from streamer.engine.scheduler.loads import Loads, check_holds, host_tier
from streamer.engine.scheduler.pages import Pages
from streamer.engine.scheduler.stats import Counters
from streamer.engine.spec.rollback import ahead_budget, proposals
from streamer.engine_stats import EngineStats
from streamer.kv.pages import PagePool
from streamer.kv.radix import RadixCache
from streamer.messages import Batch, MaskFill, StepOutput, TokenDelta, TokenizedRequest
from streamer.speculative_config import SpeculativeConfig


class Scheduler:
    """The policy, synchronous and deterministic (the actor loop is `run`)."""

    jump_forward = True
    """Append the text a grammar forces without decoding it token by token (tests flip it)."""

    def __init__(
        self,
        config: EngineConfig,
        pool: PagePool,
        max_model_len: int,
        vocab_size: int = 0,
        diagnostics: Diagnostics | None = None,
        kv_window: int = 0,
    ) -> None:
        """kv_window: the model's (model.windows.kv_window); > 0 releases the pages behind
        every request's window as it advances (Pages.trim)."""
        self.config = config
        self.vocab_size = vocab_size
        self.pool = pool
        self.tree = RadixCache(pool, host_tier(config, pool))
        self.loads = Loads(pool, self.tree)
        """Prefixes coming back from the host tier (loads.py)."""
        self.keeps = Keeps(self.tree)
        """Prefixes pinned for WebSocket sessions (keeps.py)."""
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        """Every request here, by id: waiting, running or retrying."""
        self.in_flight: Counter[str] = Counter()
        """request id -> number of batches in flight that contain it."""
        self.pages = Pages(pool, self.tree, config.enable_prefix_caching, self.running, self.waiting, kv_window)
        self.pages.keeps = self.keeps
        self.deadlines = Deadlines(self.requests)
        self.counters = Counters()
        self.batches = BatchBuilder(pool, vocab_size, self.counters, self.in_flight)
        self.clock = AheadClock(config.hold_ahead_ms / 1e3)
        """Driven by the actor loop; here for the stats."""
        self.diagnostics = diagnostics if diagnostics is not None else Diagnostics.from_env()
        self.early_aborts: dict[str, float] = {}
        """Aborted before they reached the scheduler (still in the tokenizer)."""
        self.jumps: list[tuple[Request, TokenDelta]] = []
        """Requests whose grammar may force text after the last process() (jump-forward)."""
        self.spec: SpeculativeConfig | None = config.speculative_config
        self.loras: set[str] = {lora_key(name, k) for k, (name, _) in enumerate(config.lora_adapters)}
        """The keys of the LoRA adapters served (engine/adapters.py): a request of another is refused."""
        """Speculative decoding (spec/rollback.py), or None."""

    # ---- arrivals and departures ------------------------------------------
    def add(self, msg: TokenizedRequest) -> TokenDelta | None:
        """Queue a request, or refuse it at once (returned delta carries the error)."""
        if self.early_aborts.pop(msg.request_id, None) is not None:
            return TokenDelta(msg.request_id, [], finish_reason="abort")
        p = msg.params
        if p.lora is not None and p.lora not in self.loras:  # (tokenized before its adapter was unloaded)
            return TokenDelta(msg.request_id, [], finish_reason="error", error=unloaded(p.lora))
        deadline = None if p.timeout is None else (msg.arrival or time.monotonic()) + p.timeout
        if deadline is not None and deadline <= time.monotonic():  # (it spent it in the tokenizer)
            return TokenDelta(msg.request_id, [], finish_reason="timeout", error=timed_out(p, "tokenized"))
        need = len(msg.prompt_token_ids) + p.max_tokens
        if self.pool.pages_for(need) > self.pool.capacity:
            return TokenDelta(
                msg.request_id,
                [],
                finish_reason="error",
                error=(
                    f"prompt ({len(msg.prompt_token_ids)} tokens) + max_tokens ({p.max_tokens}) needs "
                    f"{self.pool.pages_for(need)} KV pages; the pool has {self.pool.capacity}"
                ),
            )
        req = Request(
            msg.request_id,
            len(msg.prompt_token_ids),
            list(msg.prompt_token_ids),
            p,
            frozenset(msg.eos_token_ids),
            grammar=msg.grammar,
            deadline=deadline,
            prediction=np.asarray(msg.prediction, dtype=np.int64) if msg.prediction else None,
            bad_words=msg.bad_words,
        )
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.deadlines.add(req)
        return None

    def finish(self, request_id: str, reason: str) -> TokenDelta | None:
        """Abort or stop-string finish (its pages wait for any batch in flight that holds it)."""
        req = self.requests.get(request_id)
        if req is None:
            if self.keeps.release(request_id):  # a keep_prefix key: its session has closed
                return None
            if reason == "abort":
                now = time.monotonic()
                self.early_aborts = {k: t for k, t in self.early_aborts.items() if now - t < 300}
                self.early_aborts[request_id] = now
            return None
        return self.retire(req, reason)

    def update_lora(self, key: str, loaded: bool) -> list[TokenDelta]:
        """An adapter's key served from now on, or no longer: every request of it still here
        ends with an error."""
        if loaded:
            self.loras.add(key)
            return []
        self.loras.discard(key)
        return [self.retire(r, "error", error=unloaded(key)) for r in list(self.requests.values())
                if r.params.lora == key]

    def abort_all(self) -> list[TokenDelta]:
        """Stopping: every request still here ends with "abort"."""
        return [self.retire(req, "abort") for req in list(self.requests.values())]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request still here: the actor loop wakes up for it."""
        times = [t for t in (self.deadlines.next(), self.loads.wake(), self.keeps.next()) if t is not None]
        return min(times, default=None)

    def expire(self, now: float) -> list[TokenDelta]:
        """End every request whose deadline has passed, wherever it is (queued, running,
        retrying): finish_reason "timeout"; its pages are freed (once no batch in flight
        holds them)."""
        self.keeps.expire(now)
        out = []
        for req in self.deadlines.due(now):
            where = "running" if req.status == Status.RUNNING or req.admitted_once else "queued"
            out.append(self.retire(req, "timeout", error=timed_out(req.params, where)))
        return out

    def retire(self, req: Request, reason: str, error: str | None = None) -> TokenDelta:
        """End req wherever it is (queued, running, retrying); its pages go now or once no
        batch in flight holds them. The returned delta is its last."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self.pages.leave(req, self.in_flight)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
            self.loads.forget(req)
        req.status = Status.FINISHED
        self.requests.pop(req.request_id, None)
        self.counters.finished_total += 1
        d = results.delta(req, [])
        d.finish_reason, d.error = reason, error
        return d

    # ---- one iteration --------------------------------------------------
    def schedule(self, ahead: bool = False) -> Batch | None:
        """Build the next batch. ahead=True: a batch is still in flight (overlap), so the
        sampled tokens it will produce are placeholders here, and nothing is preempted
        (its pages may be in use); a request that cannot grow just sits this step out."""
        budget = self.config.max_num_batched_tokens
        self.loads.poll()
        chunks: list[tuple[Request, int]] = []
        preempted = False
        suspect = next((r for r in self.running if r.suspect), None)
        if suspect is None:
            waiting = next((r for r in self.waiting if r.suspect), None)
            if waiting is not None:
                self._admit(chunks, budget, only=waiting)
                if chunks:
                    self.counters.steps_ahead += ahead
                    return self.batches.build(chunks, ahead)
        off = self.spec is not None and self.spec.disable_by_batch_size is not None \
            and len(self.running) >= self.spec.disable_by_batch_size
        for req in [suspect] if suspect is not None else self._in_order(self.running):
            if req.status != Status.RUNNING or budget == 0 or self._awaiting_last_token(req):
                continue
            n = min(req.remaining, budget)
            if self.spec is not None and n == 1:  # speculative decoding: a verify chunk (spec/)
                if req.request_id in self.in_flight:  # (overlap: this batch is built ahead of its tokens)
                    if req.verifying or (req.ahead_left <= 0 and not off):
                        continue  # it waits for its tokens (and proposes then)
                    if not off:
                        req.ahead_left -= 1  # a plain decode ahead: its proposals keep failing
                elif off:
                    req.draft = []  # (the batch is large: disable_by_batch_size)
                else:
                    req.draft = proposals(self.spec, req, budget, self.max_model_len, self.in_flight, ahead)
                    req.spec_misses = 0 if req.draft else req.spec_misses + 1
                    req.ahead_left = ahead_budget(req.spec_misses)
                if req.draft and not self.pages.grow(req, req.num_computed + 1 + len(req.draft)):
                    req.draft = []  # no pages for the proposals: a plain decode
                n += len(req.draft)
            while not self.pages.grow(req, req.num_computed + n):
                if ahead:
                    break
                victim = self._in_order(self.running)[-1]  # (the last of this loop's order: not yet scheduled)
                self.pages.preempt(victim)
                self.counters.preemptions += 1
                preempted = True
                if victim is req:
                    break
            if ahead and self.pool.pages_for(req.num_computed + n) > len(req.pages):
                continue
            if req.status != Status.RUNNING:
                continue
            chunks.append((req, n))
            budget -= n
        if not preempted and suspect is None:
            budget = self._admit(chunks, budget)
        if not chunks:
            return None
        # One-token chunks first (decodes, and admitted requests whose prompt was cached but
        # for its last token), the longest context first: the decode kernel's programs start
        # in batch order, so the longest sequences do not form the tail of its last wave; and
        # one-token chunks leading a mixed step can go through the decode kernel
        # (runner.prepare), which reads a sequence's pages once per KV head where the extend
        # kernel reads them once per query head. Decodes all grow by one token a step, so
        # the list is nearly sorted already.
        chunks.sort(key=lambda c: (c[1] != 1, -c[0].num_computed))
        self.counters.steps_ahead += ahead
        return self.batches.build(chunks, ahead)

    def _in_order(self, reqs: list[Request]) -> list[Request]:
        """Running requests in the order they are served and kept: as they were admitted, or
        with scheduling_policy priority by (priority, arrival)."""
        if self.config.scheduling_policy != "priority":
            return list(reqs)
        return sorted(reqs, key=lambda r: (r.params.priority, r.arrival))

    def _awaiting_last_token(self, req: Request) -> bool:
        """Its final token is already being sampled by a batch in flight."""
        return req.num_output >= req.params.max_tokens or len(req.tokens) >= self.max_model_len

    def can_overlap(self) -> bool:
        """Scheduling ahead needs no sampled token's value on the host: no penalties and no bad
        words of several tokens (they read the output so far), and no jump-forward (it appends
        tokens where the batch ahead already placed its own). Grammar rows are fine: their masks
        are deferred."""
        for r in self.running:
            p = r.params
            if r.grammar is not None and self.jump_forward:
                return False
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or r.needs_last_tokens:
                return False
        return True

    def _admit(self, chunks: list[tuple[Request, int]], budget: int, only: Request | None = None) -> int:
        """Move waiting requests to running while the budget and the pages allow. Suspects
        are admitted alone, through `only`."""
        if not self.waiting or budget == 0 or len(self.running) >= self.config.max_num_seqs:
            # (a full batch admits nobody: spare the cache-aware ordering's tree walks, one
            # per waiting prompt, that every step would otherwise repeat)
            return budget
        order = [only] if only is not None else [r for r in self.waiting if not r.suspect]
        matches: dict[str, tuple[list[int], Any]] = {}
        if self.config.enable_prefix_caching and len(order) <= self.config.fcfs_queue_threshold:
            # cache-aware: the longest cached prefix first (stable, so FCFS among equals)
            for r in order:
                matches[r.request_id] = self.tree.peek(r.tokens[: self.pages.cacheable(r)], r.params.cache_salt)
            order.sort(key=lambda r: -len(matches[r.request_id][0]))
        if self.config.scheduling_policy == "priority":  # (stable: the order above among equal priorities)
            order.sort(key=lambda r: r.params.priority)
        claimed = {r.claim for r in self.running if r.claim is not None}
        for req in order:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            pages: list[int] = []
            node = None
            if self.config.enable_prefix_caching:
                if not self.loads.prefetch(req, req.tokens[: self.pages.cacheable(req)]):
                    continue  # its prefix is on its way back from the host: the others go first
                pages, node = self.tree.match_prefix(req.tokens[: self.pages.cacheable(req)], req.params.cache_salt)
                claim = self.pages.claim(req, len(pages))
                if claim is not None and claim in claimed:
                    # another request is prefilling this very page on the same prefix: wait for
                    # it to reach the tree rather than compute the shared prefix twice
                    continue
                req.claim = claim
                if claim is not None:
                    claimed.add(claim)
            self.pages.adopt(req, pages, node)
            computed = req.num_computed
            n = min(len(req.tokens) - computed, budget)
            if not self.pages.grow(req, computed + n):
                self.pages.release(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            if not req.admitted_once:
                req.admitted_once = True
                req.queue_time = time.monotonic() - req.arrival
                req.cached_tokens = computed
                req.cached_host_tokens = min(self.loads.admitted(req), computed)
                self.counters.cached_host_tokens_total += req.cached_host_tokens
                self.counters.cached_tokens_total += computed
                self.counters.prompt_tokens_total += req.prompt_len
            chunks.append((req, n))
            budget -= n
        return budget

    def fill_deferred(self, step: int) -> MaskFill:
        """The bitmask of batch `step` (sent with masks_deferred), from the matchers as they
        are now: the step before it has been processed."""
        fill = self.batches.fill_deferred(step)
        self.diagnostics.on_mask_fill(step)
        return fill

    def fill_drafted(self, step: int, drafts: dict[str, list[int]]) -> MaskFill:
        """The bitmask of batch `step` (sent with masks_await_drafts), from the proposals the
        draft drew in it."""
        fill = self.batches.fill_drafted(step, drafts)
        self.diagnostics.on_mask_fill(step)
        return fill

    # ---- step results (results.py) ----------------------------------------
    def process(self, batch: Batch, out: StepOutput) -> list[TokenDelta]:
        """A step's output in: tokens appended, requests ended; the deltas for the detokenizer."""
        self.batches.forget(batch.step)  # (a step that failed before its masks were asked for)
        return results.process(self, batch, out)

    def compute_jumps(self) -> list[list[int]]:
        """Jump-forward, in a thread: the tokens each grammar in `jumps` forces (results.py)."""
        return results.compute_jumps(self.jumps, self.max_model_len)

    def apply_jumps(self, forced: list[list[int]]) -> list[TokenDelta]:
        return results.apply_jumps(self, forced)

    # ---- state ------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> EngineStats:
        return self.counters.snapshot(
            self.batches.step_id, len(self.running), len(self.waiting), self.pool, self.tree, self.clock, time.monotonic()
        )

    def step_age(self) -> float:
        """Seconds the oldest batch in flight has been with the executor (0: none)."""
        return self.clock.step_age(time.monotonic())

    def check(self) -> None:
        """The page invariant (Pages.check); every lock and pin has its holder."""
        self.pages.check()
        holders = [*self.running, *self.pages.zombies.values(), *self.pages.retrying.values()]
        locks = [r.node for r in holders if r.node is not None]
        locks += [ld.node for ld in [*self.loads.pending.values(), *self.loads.orphans]]
        check_holds(self.tree, locks, [node for node, _ in self.keeps.kept.values()])
