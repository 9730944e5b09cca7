"""Scheduler actor: admits and retires requests against one paged + radix KV pool.

Inbox:  TokenizedRequest (new work), StepOutput (from the executor),
        Abort (from callers), Finish (from the detokenizer: a stop string matched).
Outbox: Batch, MaskFill -> executor; list[TokenDelta] -> detokenizer.

NOTE: there are no prefill and decode phases. Every running request just
catches its KV up: `num_computed` chases `len(tokens)`. A prefill is a chunk
of many tokens, a decode is a chunk of one; both share the per-step token
budget, and a chunk that reaches the last token samples the next one.

Invariants:
  - at most one Batch is in flight, two with overlap scheduling (the second is
    built while the first runs; its tokens to come are PLACEHOLDERs); requests
    in a batch are retired only when its StepOutput is back (the GPU may still
    be writing their pages);
  - a batch scheduled ahead with grammar rows gets its MaskFill right after
    the StepOutput of the batch before it is processed, before anything else
    goes to the executor;
  - every page is free, held by a running request, or held by the radix tree
    (PagePool refcounts count the holders);
  - a request holds a lock on the radix node of its cached prefix while it runs;
  - prefixes are matched, claimed and cached within the request's cache_salt only;
  - a request with SamplingParams.timeout ends ("timeout") once its deadline has passed,
    wherever it is: the loop wakes up for the earliest deadline even with no message.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import logging
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from streamer.config import EngineConfig
from streamer.engine.request import Request, Status
from streamer.kv.pages import PagePool
from streamer.kv.radix import RadixCache
from streamer.messages import (
    Abort,
    Batch,
    EngineStats,
    Finish,
    MaskFill,
    SamplingParams,
    SeqChunk,
    StepOutput,
    TokenDelta,
    TokenizedRequest,
)

log = logging.getLogger("streamer.scheduler")

PLACEHOLDER = -1
"""A token being sampled by a batch in flight; the runner reads its value on the device."""


class Scheduler:
    """The policy, synchronous and deterministic (the actor loop is `run`)."""

    jump_forward = True
    """Append the text a grammar forces without decoding it token by token (tests flip it)."""

    def __init__(self, config: EngineConfig, pool: PagePool, max_model_len: int, vocab_size: int = 0) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.pin_masks = pool.k.is_cuda  # grammar bitmasks are filled in pinned memory for the GPU
        """Width of the grammar bitmasks."""
        self.pool = pool
        self.tree = RadixCache(pool)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.in_flight: Counter[str] = Counter()
        """request id -> number of batches in flight that contain it."""
        self.zombies: dict[str, Request] = {}
        """Finished while in a batch in flight: pages are released when it returns."""
        self.retrying: dict[str, Request] = {}
        """Requests of a failed step, back to the queue once no batch in flight holds them."""
        self.isolated_failures = 0
        self.early_aborts: dict[str, float] = {}
        """Aborted before they reached the scheduler (still in the tokenizer)."""
        self.deadlines: list[tuple[float, str]] = []
        """Heap of (deadline, request id); entries of requests that ended stay until popped."""
        self.step_id = 0
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self.finished_total = 0
        self.batch_sizes_sum = 0
        self.max_batch_size = 0
        self._kv_live = 0
        self._kv_slots = 0
        self.jump_forward_tokens = 0
        self.steps_ahead = 0
        self.masks_deferred = 0
        self.device_busy_s = 0.0
        self.device_idle_s = 0.0
        self.built_ahead: set[int] = set()
        """Steps built while the one before was in flight (their idle_before is host lateness)."""
        self.trace = StepTrace.from_env()
        """One JSON line per step when STREAMER_STEP_TRACE names a file (diagnostics)."""
        self.deferred_masks: dict[int, list[Request]] = {}
        """Sampling requests of batches sent with masks_deferred, by step."""
        self.clock = AheadClock(config.hold_ahead_ms / 1e3)
        self.jumps: list[tuple[Request, TokenDelta]] = []
        """Requests whose grammar may force text after the last process() (jump-forward)."""

    # ---- arrivals -------------------------------------------------------
    def add(self, msg: TokenizedRequest) -> TokenDelta | None:
        """Queue a request, or refuse it at once (returned delta carries the error)."""
        if self.early_aborts.pop(msg.request_id, None) is not None:
            return TokenDelta(msg.request_id, [], finish_reason="abort")
        p = msg.params
        deadline = None if p.timeout is None else (msg.arrival or time.monotonic()) + p.timeout
        if deadline is not None and deadline <= time.monotonic():  # (it spent it in the tokenizer)
            return TokenDelta(msg.request_id, [], finish_reason="timeout", error=_timed_out(p, "tokenized"))
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
        )
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if deadline is not None:
            heapq.heappush(self.deadlines, (deadline, req.request_id))
        return None

    # ---- deadlines (SamplingParams.timeout) -------------------------------
    def next_deadline(self) -> float | None:
        """The earliest deadline of a request still here: the actor loop wakes up for it."""
        heap = self.deadlines
        while heap and not self._pending(*heap[0]):
            heapq.heappop(heap)  # (its request ended before its deadline)
        if len(heap) > 4 * len(self.requests) + 1024:  # (ended ones deeper in the heap pile up)
            self.deadlines = heap = [e for e in heap if self._pending(*e)]
            heapq.heapify(heap)
        return heap[0][0] if heap else None

    def _pending(self, deadline: float, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and req.deadline == deadline

    def expire(self, now: float) -> list[TokenDelta]:
        """End every request whose deadline has passed, wherever it is (queued, running,
        retrying): finish_reason "timeout"; its pages are freed (once no batch in flight
        holds them)."""
        out = []
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            if self._pending(deadline, rid):
                req = self.requests[rid]
                where = "running" if req.status == Status.RUNNING or req.admitted_once else "queued"
                out.append(self._finish(req, "timeout", error=_timed_out(req.params, where)))
        return out

    # ---- one iteration --------------------------------------------------
    def schedule(self, ahead: bool = False) -> Batch | None:
        """Build the next batch. ahead=True: a batch is still in flight (overlap), so the
        sampled tokens it will produce are placeholders here, and nothing is preempted
        (its pages may be in use); a request that cannot grow just sits this step out."""
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        preempted = False
        suspect = next((r for r in self.running if r.suspect), None)
        if suspect is None:
            waiting = next((r for r in self.waiting if r.suspect), None)
            if waiting is not None:
                self._admit(chunks, budget, only=waiting)
                if chunks:
                    self.steps_ahead += ahead
                    return self._build(chunks, ahead)
        for req in [suspect] if suspect is not None else list(self.running):
            if req.status != Status.RUNNING or budget == 0 or self._awaiting_last_token(req):
                continue
            n = min(req.remaining, budget)
            while not self._grow(req, req.num_computed + n):
                if ahead:
                    break
                victim = self.running[-1]
                self._preempt(victim)
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
        self.steps_ahead += ahead
        return self._build(chunks, ahead)

    def _awaiting_last_token(self, req: Request) -> bool:
        """Its final token is already being sampled by a batch in flight."""
        return req.num_output >= req.params.max_tokens or len(req.tokens) >= self.max_model_len

    def can_overlap(self) -> bool:
        """Scheduling ahead needs no sampled token's value on the host: no penalties (they
        read the output so far) and no jump-forward (it appends tokens where the batch
        ahead already placed its own). Grammar rows are fine: their masks are deferred."""
        for r in self.running:
            p = r.params
            if r.grammar is not None and self.jump_forward:
                return False
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
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
                matches[r.request_id] = self.tree.peek(r.tokens[: self._cacheable(r)], r.params.cache_salt)
            order.sort(key=lambda r: -len(matches[r.request_id][0]))
        claimed = {r.claim for r in self.running if r.claim is not None}
        for req in order:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            pages: list[int] = []
            node = None
            if self.config.enable_prefix_caching:
                pages, node = self.tree.match_prefix(req.tokens[: self._cacheable(req)], req.params.cache_salt)
                claim = self._claim(req, len(pages))
                if claim is not None and claim in claimed:
                    # another request is prefilling this very page on the same prefix: wait for
                    # it to reach the tree rather than compute the shared prefix twice
                    continue
                req.claim = claim
                if claim is not None:
                    claimed.add(claim)
                self.tree.lock(node)
            computed = len(pages) * self.pool.page_size
            n = min(len(req.tokens) - computed, budget)
            self.pool.incref(pages)
            req.pages, req.num_computed, req.node = list(pages), computed, node
            if not self._grow(req, computed + n):
                self._release(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            if not req.admitted_once:
                req.admitted_once = True
                req.queue_time = time.monotonic() - req.arrival
                req.cached_tokens = computed
                self.cached_tokens_total += computed
                self.prompt_tokens_total += req.prompt_len
            chunks.append((req, n))
            budget -= n
        return budget

    def _claim(self, req: Request, cached_pages: int) -> int | None:
        """Identity of the first page req would compute (None: no full page to compute), in
        its cache namespace (requests of other salts do not wait for it: they cannot share)."""
        end = (cached_pages + 1) * self.pool.page_size
        if self._cacheable(req) < end:
            return None
        return hash((req.params.cache_salt, tuple(req.tokens[:end])))

    @staticmethod
    def _cacheable(req: Request) -> int:
        """How many leading tokens may come from the cache: never the last one (its
        logits are needed), nor those whose prompt logprobs were asked for."""
        n = len(req.tokens) - 1
        start = req.params.prompt_logprobs_from
        if start is not None and not req.admitted_once:
            n = min(n, max(start - 1, 0))
        return n

    def _grow(self, req: Request, num_tokens: int) -> bool:
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

    def _build(self, chunks: list[tuple[Request, int]], ahead: bool = False) -> Batch:
        self.step_id += 1
        if ahead:
            self.built_ahead.add(self.step_id)
        seqs, params, hist, banned = [], [], [], []
        for req, n in chunks:
            start = req.num_computed
            sample = start + n == len(req.tokens)
            chunk = SeqChunk(
                req.request_id,
                req.tokens[start : start + n],
                start,
                req.pages[: self.pool.pages_for(start + n)],
                sample,
            )
            want = req.params.prompt_logprobs_from
            if want is not None and req.num_output == 0:
                # position p predicts token p+1: positions [want-1, prompt_len-2] are needed
                lo, hi = max(want - 1, start), min(req.prompt_len - 1, start + n)
                if lo < hi:
                    chunk.logprob_from = lo - start
                    chunk.logprob_targets = req.tokens[lo + 1 : hi + 1]
            seqs.append(chunk)
            self.in_flight[req.request_id] += 1
            # the step will compute these tokens: later batches build on them at once
            req.num_computed = start + n
            if sample:
                params.append(req.params)
                p = req.params
                # the sampler needs the output so far only for penalties and seeded draws
                needed = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.seed is not None
                hist.append(req.output if needed else [])
                ban: list[int] = []
                if req.num_output < req.params.min_tokens:
                    ban = sorted(req.eos_token_ids | set(req.params.stop_token_ids))
                banned.append(ban)
                # the token this step samples; process() writes its value in place
                req.tokens.append(PLACEHOLDER)
        self.batch_sizes_sum += len(seqs)
        self.max_batch_size = max(self.max_batch_size, len(seqs))
        sampling = [r for r, n in chunks if r.num_computed == len(r.tokens) - 1]
        if not any(r.grammar is not None for r in sampling):
            return Batch(self.step_id, seqs, params, hist, banned)
        if ahead:
            # the batch in flight will move these matchers: fill once its tokens are in
            self.deferred_masks[self.step_id] = sampling
            self.masks_deferred += 1
            return Batch(self.step_id, seqs, params, hist, banned, masks_deferred=True)
        return Batch(self.step_id, seqs, params, hist, banned, self._grammar_masks(sampling))

    def _grammar_masks(self, sampling: list[Request]) -> Any:
        from streamer.sampling.grammar import fill_bitmask

        # a request that ended meanwhile (stop, abort, grammar complete) samples unconstrained:
        # its token is dropped, and a terminated matcher has no mask to give
        states = [
            r.grammar
            if r.grammar is not None and r.status == Status.RUNNING and not r.grammar.is_terminated()
            else None
            for r in sampling
        ]
        return fill_bitmask(states, self.vocab_size, pin=self.pin_masks)

    def fill_deferred(self, step: int) -> MaskFill:
        """The bitmask of batch `step` (sent with masks_deferred), from the matchers as they
        are now: the step before it has been processed."""
        fill = MaskFill(step, self._grammar_masks(self.deferred_masks.pop(step)))
        if self.trace is not None:
            self.trace.filled[step] = time.perf_counter()
        return fill

    # ---- results --------------------------------------------------------
    def process(self, batch: Batch, out: StepOutput) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        self.device_busy_s += out.device_time - out.mask_wait
        ahead = batch.step in self.built_ahead
        if ahead:  # (before a batch built with none in flight, the device may just have had no work)
            self.built_ahead.discard(batch.step)
            self.device_idle_s += out.idle_before
        self.device_idle_s += out.mask_wait
        t_begin, c_begin = time.perf_counter(), time.thread_time()
        sampled = iter(out.sampled)
        isolate = False
        if out.error is not None:
            # one request's bad input must not fail the others: each goes back to the queue
            # and runs its next step alone; a request that fails alone fails. (Count every
            # request of the step, also those already retrying: a step built on a failed one
            # may fail because of them.)
            isolate = len({s.request_id for s in batch.seqs}) > 1
            if isolate:
                self.isolated_failures += 1
                log.warning("step %d failed with %d requests; each runs alone next: %s",
                            batch.step, len(batch.seqs), out.error)
        for seq in batch.seqs:
            self.in_flight[seq.request_id] -= 1
            if self.in_flight[seq.request_id] <= 0:
                del self.in_flight[seq.request_id]
            req = self.requests.get(seq.request_id)
            tok = next(sampled) if seq.sample and out.error is None else None
            if req is None or req.status != Status.RUNNING:
                continue
            if out.error is not None:
                if isolate and not req.suspect:
                    self._retry_later(req, seq.start)
                else:
                    deltas.append(self._finish(req, "error", error=out.error))
                continue
            if seq.request_id in out.prompt_logprobs:
                req.prompt_logprobs.extend(out.prompt_logprobs[seq.request_id])
            if tok is None:
                continue
            req.suspect = False  # it sampled alone without failing: batched again from now
            at = seq.start + len(seq.token_ids)
            req.tokens[at] = tok.token_id
            self.generated_tokens_total += 1
            if at == req.prompt_len and self.config.enable_prefix_caching:
                self._cache_prompt(req)
            reason = self._stop_reason(req, tok.token_id, at + 1)
            if reason is not None:
                del req.tokens[at + 1 :]  # placeholders of batches still in flight
            logprobs = [tok] if req.params.logprobs is not None else None
            new = [tok.token_id]
            if reason is None:
                d = self._delta(req, new, logprobs)
                deltas.append(d)
                if req.grammar is not None and self.jump_forward and req.params.logprobs is None:
                    self.jumps.append((req, d))
            else:
                error = self._grammar_error(req) if reason == "error" else None
                d = self._finish(req, reason, error=error)
                if error is None:  # a token the grammar refused is not output
                    d.token_ids, d.logprobs = new, logprobs
                deltas.append(d)
        # KV efficiency: of the slots in pages held by running requests, how many hold tokens
        self._kv_live += sum(r.num_computed for r in self.running)
        self._kv_slots += sum(len(r.pages) for r in self.running) * self.pool.page_size
        for rid in [r for r in self.zombies if r not in self.in_flight]:
            self._release(self.zombies.pop(rid))
        for rid in [r for r in self.retrying if r not in self.in_flight]:
            self._requeue(self.retrying.pop(rid))
        if self.trace is not None:
            self.trace.write(batch, out, ahead, t_begin, c_begin)
        return deltas

    def _retry_later(self, req: Request, valid: int) -> None:
        """Take req out of a failed step: only tokens[:valid] have trustworthy KV (the failed
        chunk started there; batches after it built on its output). Back to the queue once
        no batch in flight holds its pages."""
        self.running.remove(req)
        req.status = Status.WAITING
        req.suspect = True
        req.num_computed = min(req.num_computed, valid)
        self.retrying[req.request_id] = req

    def _requeue(self, req: Request) -> None:
        self._release(req)  # the valid prefix goes to the tree: the retry mostly hits it
        if req.status == Status.FINISHED:  # aborted while its batches drained
            return
        while len(req.tokens) > req.prompt_len and req.tokens[-1] == PLACEHOLDER:
            req.tokens.pop()  # sampled by the failed step or a batch after it
        self.waiting.appendleft(req)

    def _stop_reason(self, req: Request, token: int, length: int) -> str | None:
        """Why req ends at `token`, the last of its first `length` tokens (None: it goes on)."""
        p = req.params
        num_output = length - req.prompt_len
        if req.grammar is not None:
            if not req.grammar.accept(token):
                return "error"
            if req.grammar.is_terminated():
                return "stop"
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                return "stop"
        if num_output >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _grammar_error(self, req: Request) -> str:
        """Why req's grammar refused its sampled token. The usual cause: from here the grammar
        admits no token of this model's vocabulary (a character no token sequence spells, say),
        so every logit was masked; a user's constraint, not an engine failure."""
        from streamer.sampling.grammar import fill_bitmask

        assert req.grammar is not None
        if self.vocab_size and not bool(fill_bitmask([req.grammar], self.vocab_size).any()):
            return (f"the grammar admits no token of this model's vocabulary after {req.grammar.num_accepted} "
                    "output token(s): the constraint cannot be met with this tokenizer")
        return "internal error: the sampled token is not allowed by the grammar"

    # ---- jump-forward ---------------------------------------------------
    # After process(), the requests in `jumps` may have text their grammar forces next. The
    # actor loop finds it in a thread (compute_jumps: matcher work, bounded, but not for the
    # event loop) and waits for it before anything else touches the scheduler; apply_jumps
    # then appends the tokens, which the next step computes as one multi-token chunk. Not for
    # requests that want logprobs (a forced token has no sampled distribution to report).

    def compute_jumps(self) -> list[list[int]]:
        """The forced tokens of each request in `jumps` (already accepted by its matcher), at
        most what its max_tokens and the context leave. Touches only those matchers."""
        from streamer.sampling.grammar import JUMP_MAX_BYTES, JUMP_STEP_BYTES

        out = []
        budget = JUMP_STEP_BYTES  # (once spent, the others jump after the next step)
        for req, _ in self.jumps:
            assert req.grammar is not None
            limit = min(req.params.max_tokens - req.num_output, self.max_model_len - len(req.tokens))
            toks = req.grammar.jump_forward(limit, min(JUMP_MAX_BYTES, budget))
            budget -= req.grammar.jump_bytes + 1
            out.append(toks)
        return out

    def apply_jumps(self, forced: list[list[int]]) -> list[TokenDelta]:
        """Append compute_jumps' tokens to their requests and deltas; the deltas of requests
        that a forced token ends (a stop token, max_tokens, the context)."""
        ended: list[TokenDelta] = []
        for (req, d), toks in zip(self.jumps, forced):
            p = req.params
            reason = None
            for t in toks:
                req.tokens.append(t)
                d.token_ids.append(t)
                self.generated_tokens_total += 1
                self.jump_forward_tokens += 1
                if req.num_output >= p.min_tokens and (
                    t in p.stop_token_ids or (not p.ignore_eos and t in req.eos_token_ids)
                ):
                    reason = "stop"
                    break
            if reason is None and (req.num_output >= p.max_tokens or len(req.tokens) >= self.max_model_len):
                reason = "length"
            if reason is not None:
                ended.append(self._finish(req, reason))
        self.jumps = []
        return ended

    def _delta(self, req: Request, tokens: list[int], logprobs=None) -> TokenDelta:
        d = TokenDelta(req.request_id, tokens, logprobs)
        if not req.sent_prompt_info:
            req.sent_prompt_info = True
            d.prompt_tokens, d.cached_tokens = req.prompt_len, req.cached_tokens
            d.queue_time = req.queue_time
            if req.params.prompt_logprobs_from is not None:
                d.prompt_logprobs = req.prompt_logprobs
        return d

    def _cache_prompt(self, req: Request) -> None:
        """Share a freshly prefilled prompt with later arrivals (lock moves to the longer path)."""
        _, node = self.tree.insert(req.tokens[: req.prompt_len], req.pages, req.params.cache_salt)
        req.claim = None  # its prefix is in the tree now: waiting requests can share it
        self.tree.lock(node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node = node

    # ---- leaving --------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Give back req's pages: full computed pages to the tree, the rest to the pool."""
        known = len(req.tokens)
        while known and req.tokens[known - 1] == PLACEHOLDER:  # sampled by a batch that was dropped
            known -= 1
        computed = min(req.num_computed, known)
        if self.config.enable_prefix_caching and computed:
            self.tree.insert(req.tokens[:computed], req.pages, req.params.cache_salt)
        self.pool.decref(req.pages)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.pages, req.node, req.num_computed = [], None, 0

    def _preempt(self, req: Request) -> None:
        """Recompute later: pages go to the tree, so the resume is mostly a cache hit."""
        log.debug("preempt %s at %d tokens", req.request_id, req.num_computed)
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        if req.grammar is not None:
            # the matcher has accepted exactly the output tokens, which a preemption keeps
            assert req.grammar.num_accepted == req.num_output, "grammar state out of step with tokens"
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> TokenDelta:
        if req.status == Status.RUNNING:
            self.running.remove(req)
            if req.request_id in self.in_flight:
                self.zombies[req.request_id] = req  # the GPU may still write its pages
            else:
                self._release(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.requests.pop(req.request_id, None)
        self.finished_total += 1
        d = self._delta(req, [])
        d.finish_reason, d.error = reason, error
        return d

    def finish(self, request_id: str, reason: str) -> TokenDelta | None:
        """Abort or stop-string finish (its pages wait for any batch in flight that holds it)."""
        req = self.requests.get(request_id)
        if req is None:
            if reason == "abort":
                now = time.monotonic()
                self.early_aborts = {k: t for k, t in self.early_aborts.items() if now - t < 300}
                self.early_aborts[request_id] = now
            return None
        return self._finish(req, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> EngineStats:
        cached = self.tree.cached_pages
        used = self.pool.capacity - self.pool.num_free
        steps = max(self.step_id, 1)
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            pages_total=self.pool.capacity,
            pages_free=self.pool.num_free,
            pages_cached=cached,
            pages_used=used,
            cache_hit_rate=(self.cached_tokens_total / self.prompt_tokens_total) if self.prompt_tokens_total else 0.0,
            cached_tokens_total=self.cached_tokens_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            preemptions=self.preemptions,
            steps=self.step_id,
            max_batch_size=self.max_batch_size,
            mean_batch_size=self.batch_sizes_sum / steps,
            kv_efficiency=(self._kv_live / self._kv_slots) if self._kv_slots else 1.0,
            requests_finished=self.finished_total,
            jump_forward_tokens=self.jump_forward_tokens,
            steps_ahead=self.steps_ahead,
            masks_deferred=self.masks_deferred,
            steps_held=self.clock.held,
            held_steps_joined=self.clock.joined,
            held_steps_late=self.clock.late,
            device_busy_s=self.device_busy_s,
            device_idle_s=self.device_idle_s,
            step_age_s=self.step_age(),
        )

    def step_age(self) -> float:
        """Seconds the oldest batch in flight has been with the executor (0: none)."""
        return time.monotonic() - min(self.clock.sent.values()) if self.clock.sent else 0.0

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
            for p in r.pages:
                expect[p] += 1
        assert expect == self.pool.refcount, "page refcounts do not match their holders"


class AheadClock:
    """When to schedule the batch after the running one (overlap).

    Scheduled at once, it queues on the GPU behind the running step, and a request that
    arrives meanwhile waits for both. While only decodes run, nobody waits and a new request
    could be admitted, it is better scheduled just before the running step ends: an arrival
    until then joins it. The end is predicted from the device time of recent decode steps
    (StepOutput.device_time), counted from when the step could start (the output before it,
    or its own sending). The margin covers the host's time to build and launch the next
    batch; it grows whenever a held batch reached the device late (StepOutput.idle_before)
    and decays with every decode step. A margin past half the step is not worth holding for.
    """

    def __init__(self, margin_s: float) -> None:
        self.margin = margin_s
        self.extra = 0.0
        """Learned on top of margin: how late held batches were."""
        self.decode_s: float | None = None
        """Moving average of the device time of a decode-only step."""
        self.sent: dict[int, float] = {}
        self.held_steps: set[int] = set()
        self.last_out = 0.0
        self.held = 0
        """Batches scheduled after a hold."""
        self.joined = 0
        """Of those, batches that admitted a request arriving during the hold."""
        self.late = 0
        """Of those, batches that reached the device after it had gone idle."""

    def on_send(self, batch: Batch, now: float, held: bool = False) -> None:
        self.sent[batch.step] = now
        if held:
            self.held_steps.add(batch.step)
            self.held += 1

    def on_output(self, batch: Batch, out: StepOutput, now: float) -> None:
        self.sent.pop(batch.step, None)
        self.last_out = now
        if batch.step in self.held_steps:
            self.held_steps.discard(batch.step)
            if out.idle_before > 5e-5:
                self.late += 1
                self.extra += out.idle_before + 2e-4
        if out.error is None and out.device_time > 0 and _decode_only(batch):
            self.extra *= 0.98  # (so a slow patch, such as the warm-up's, is forgotten in ~100 steps)
            d = out.device_time
            self.decode_s = d if self.decode_s is None else 0.7 * self.decode_s + 0.3 * d

    def hold_until(self, running: Batch, sched: Scheduler) -> float | None:
        """When to schedule the batch after `running`; None: now."""
        if self.margin <= 0 or self.decode_s is None or sched.waiting or not _decode_only(running):
            return None
        if len(sched.running) >= sched.config.max_num_seqs:
            return None  # a request arriving now could not join anyway
        margin = self.margin + self.extra
        if margin > self.decode_s / 2:
            return None  # too short a step (or too slow a host) to be worth holding the next one
        start = max(self.sent.get(running.step, 0.0), self.last_out)
        return start + self.decode_s - margin


def _decode_only(batch: Batch) -> bool:
    return all(len(s.token_ids) == 1 for s in batch.seqs)


def _timed_out(p: SamplingParams, where: str) -> str:
    return f"the request timed out: its deadline ({p.timeout:g} s) passed while it was {where}"


_HOLD_OVER = object()
"""The scheduler's wake-up when a held batch is due."""
_DEADLINE = object()
"""The scheduler's wake-up when a request's deadline is due."""


async def run(
    sched: Scheduler,
    inbox: asyncio.Queue,
    to_executor: asyncio.Queue,
    to_detokenizer: asyncio.Queue,
    overlap: bool = False,
) -> None:
    """The actor loop: handle every message; keep a step in flight while there is work.

    With overlap, a second batch is scheduled while the first runs (its decodes read the
    tokens the first one samples on the device), so the GPU never waits for the host;
    while only decodes run, not at once but shortly before the first ends (AheadClock).
    """
    loop = asyncio.get_running_loop()
    jump_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-jump")
    try:
        await _loop(sched, inbox, to_executor, to_detokenizer, overlap, loop, jump_thread)
    finally:
        jump_thread.shutdown(wait=False)


async def _loop(
    sched: Scheduler,
    inbox: asyncio.Queue,
    to_executor: asyncio.Queue,
    to_detokenizer: asyncio.Queue,
    overlap: bool,
    loop: asyncio.AbstractEventLoop,
    jump_thread: ThreadPoolExecutor,
) -> None:
    in_flight: deque[Batch] = deque()
    depth = 2 if overlap else 1
    clock = sched.clock
    hold: float | None = None
    holding = False  # the batch after in_flight[0] has been held at least once
    while True:
        msg: Any
        deadline = sched.next_deadline()
        wake = hold if deadline is None else deadline if hold is None else min(hold, deadline)
        if wake is None:
            msg = await inbox.get()
        else:
            try:  # (time.monotonic, not loop.time: uvloop's clock moves in whole milliseconds)
                async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                    msg = await inbox.get()
            except TimeoutError:
                msg = _HOLD_OVER if hold is not None and time.monotonic() >= hold else _DEADLINE
        hold_over = msg is _HOLD_OVER
        hold = None
        deltas: list[TokenDelta] = sched.expire(time.monotonic()) if deadline is not None else []
        while not hold_over and msg is not _DEADLINE:  # drain what is queued: one step sees every arrival
            if isinstance(msg, TokenizedRequest):
                refused = sched.add(msg)
                if refused is not None:
                    deltas.append(refused)
            elif isinstance(msg, StepOutput):
                done = in_flight.popleft()
                assert msg.step == done.step, "step outputs arrive in order"
                clock.on_output(done, msg, time.monotonic())
                deltas.extend(sched.process(done, msg))
                if sched.jumps:
                    forced = await loop.run_in_executor(jump_thread, sched.compute_jumps)
                    deltas.extend(sched.apply_jumps(forced))
                if in_flight and in_flight[0].masks_deferred:
                    # the next step's forward is running: its masks are filled now, on the CPU,
                    # and go straight to the executor's launch thread (executor.Inbox)
                    to_executor.put_nowait(sched.fill_deferred(in_flight[0].step))
            elif isinstance(msg, Abort | Finish):
                d = sched.finish(msg.request_id, msg.reason)
                if d is not None:
                    deltas.append(d)
            elif msg is None:  # stopping: every request still here ends with "abort"
                for req in list(sched.requests.values()):
                    deltas.append(sched._finish(req, "abort"))
                if deltas:
                    to_detokenizer.put_nowait(deltas)
                return
            if inbox.empty():
                break
            msg = inbox.get_nowait()
        if deltas:
            to_detokenizer.put_nowait(deltas)
        while len(in_flight) < depth and sched.has_work:
            if in_flight and not sched.can_overlap():
                break
            if in_flight and not hold_over:
                hold = clock.hold_until(in_flight[0], sched)
                if hold is not None and hold > time.monotonic():
                    holding = True
                    break
                hold = None
            admitted = len(sched.waiting)
            batch = sched.schedule(ahead=bool(in_flight))
            if batch is None:
                holding = False
                break
            if holding:
                clock.joined += len(sched.waiting) < admitted
            in_flight.append(batch)
            clock.on_send(batch, time.monotonic(), held=holding)
            holding = False
            to_executor.put_nowait(batch)


class StepTrace:
    """STREAMER_STEP_TRACE=path: one JSON line per step as its output is processed, to see
    where a run's time goes (benchmarks/step_trace.py summarizes a file). Times are
    time.perf_counter() seconds; device times are CUDA event measurements.

    Fields: step, seqs, tokens (computed this step), decodes (one-token chunks), ahead
    (built while the step before was in flight), device, idle_before, mask_wait, the
    executor's host milestones (launch_begin, launch_end, sample_begin, sample_end, ready),
    filled (its grammar masks were sent, masks_deferred), process_begin and processed (the
    scheduler's handling of its output); *_cpu: CPU seconds of launch, sample and process;
    loop_cpu: the event loop thread's CPU clock (time.thread_time) as process began; gc,
    gc_count: the cyclic collector's pauses since the line before (seconds, collections).
    """

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered, open for the engine's life
        self.filled: dict[int, float] = {}
        self.encoder = msgspec.json.Encoder()
        self.gc_s = 0.0
        """Seconds the cyclic GC ran (every thread stopped) since the last line."""
        self.gc_count = 0
        self._gc_began = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_began
            self.gc_count += 1

    @classmethod
    def from_env(cls) -> StepTrace | None:
        import os

        path = os.environ.get("STREAMER_STEP_TRACE")
        return cls(path) if path else None

    def write(self, batch: Batch, out: StepOutput, ahead: bool, process_begin: float, loop_cpu: float) -> None:
        rec: dict[str, Any] = {
            "step": batch.step,
            "seqs": len(batch.seqs),
            "tokens": sum(len(s.token_ids) for s in batch.seqs),
            "decodes": sum(len(s.token_ids) == 1 for s in batch.seqs),
            "ahead": ahead,
            "device": out.device_time,
            "idle_before": out.idle_before,
            "mask_wait": out.mask_wait,
            **out.host_times,
            "process_begin": process_begin,
            "process_cpu": time.thread_time() - loop_cpu,
            "loop_cpu": loop_cpu,
            "processed": time.perf_counter(),
            "gc": self.gc_s,
            "gc_count": self.gc_count,
        }
        self.gc_s, self.gc_count = 0.0, 0
        filled = self.filled.pop(batch.step, None)
        if filled is not None:
            rec["filled"] = filled
        self.file.write(self.encoder.encode(rec).decode() + "\n")

