"""BatchBuilder: the chunks the policy chose -> one Batch for the executor.

Each chunk becomes a SeqChunk (its tokens, start, page table, whether it samples, the
prompt logprobs it owes); each sampling row gets its params, the history its penalties
need and the tokens it may not draw yet (EOS before min_tokens).

Invariants:
  - building counts the chunk as computed at once (`num_computed`): later batches build
    on it while it is in flight; the token it samples is appended as a PLACEHOLDER, which
    results.process overwrites in place;
  - a batch built ahead with grammar rows goes with masks_deferred: the batch in flight will
    move those matchers, so its bitmask is filled (fill_deferred) once that batch's tokens
    are in, and the actor sends it before anything else goes to the executor;
  - a batch with a grammar request's draft_model verify chunk goes with masks_deferred and
    masks_await_drafts: its bitmask (fill_drafted) needs the proposals the executor reports
    (DraftsDrawn) from the step itself, before that step samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from streamer.engine.request import PLACEHOLDER, Request, Status
from streamer.engine.scheduler.stats import Counters
from streamer.engine.spec.rollback import drafted_rows, verify_chunk
from streamer.kv.pages import PagePool
from streamer.messages import Batch, MaskFill, SamplingParams, SeqChunk


class BatchBuilder:
    def __init__(self, pool: PagePool, vocab_size: int, counters: Counters, in_flight: Counter[str]) -> None:
        self.pool = pool
        self.vocab_size = vocab_size
        """Width of the grammar bitmasks."""
        self.pin_masks = pool.k.is_cuda  # grammar bitmasks are filled in pinned memory for the GPU
        self.counters = counters
        self.in_flight = in_flight
        """The scheduler's: request id -> number of batches in flight that contain it."""
        self.step_id = 0
        self.built_ahead: set[int] = set()
        """Steps built while the one before was in flight (their idle_before is host lateness)."""
        self.deferred_masks: dict[int, list[Request]] = {}
        """Sampling requests of batches sent with masks_deferred, by step."""
        self.drafted: dict[int, tuple[dict[int, Any], dict[int, Request]]] = {}
        """Batches sent with masks_await_drafts, by step: their verify chunks' grammar rows
        filled at build (ngram), and the first row of each the draft's proposals fill."""

    def build(self, chunks: list[tuple[Request, int]], ahead: bool = False) -> Batch:
        self.step_id += 1
        if ahead:
            self.built_ahead.add(self.step_id)
        seqs: list[SeqChunk] = []
        params: list[SamplingParams] = []
        hist: list[list[int]] = []
        banned: list[list[int]] = []
        spec = False
        spec_masks: dict[int, Any] = {}  # first row -> a verify chunk's grammar rows
        drafted: dict[int, Request] = {}  # first row -> a grammar request's verify chunk the draft fills
        for req, n in chunks:
            if req.draft:  # speculative decoding: a row per position (spec/rollback.py)
                chunk, rows_hist, rows_banned, rows_masks = verify_chunk(req, self.pool.pages_for, self.vocab_size)
                if rows_masks is not None:
                    spec_masks[len(params)] = rows_masks
                elif req.grammar is not None:  # draft_model's proposals: masks once drawn
                    drafted[len(params)] = req
                seqs.append(chunk)
                self.in_flight[req.request_id] += 1
                params.extend([req.params] * len(rows_hist))
                hist.extend(rows_hist)
                banned.extend(rows_banned)
                spec = True
                continue
            start = req.num_computed
            sample = start + n == len(req.tokens)
            chunk = SeqChunk(
                req.request_id,
                req.tokens[start : start + n],
                start,
                req.pages[: self.pool.pages_for(start + n)],
                sample,
                embed=sample and req.params.embed,
                lora=req.params.lora,
            )
            want = req.params.prompt_logprobs_from
            if want is not None and req.num_output == 0:
                # position p predicts token p+1: positions [want-1, prompt_len-2] are needed
                lo, hi = max(want - 1, start), min(req.prompt_len - 1, start + n)
                if lo < hi:
                    chunk.logprob_from = lo - start
                    chunk.logprob_targets = req.tokens[lo + 1 : hi + 1]
                    chunk.logprob_top = req.params.prompt_top_logprobs
            seqs.append(chunk)
            self.in_flight[req.request_id] += 1
            # the step will compute these tokens: later batches build on them at once
            req.num_computed = start + n
            if sample:
                params.append(req.params)
                p = req.params
                # the sampler needs the output so far only for penalties and seeded draws
                needed = p.reads_history
                hist.append(req.output if needed else [])
                ban: list[int] = []
                if req.num_output < req.params.min_tokens:
                    ban = sorted(req.eos_token_ids | set(req.params.stop_token_ids))
                if req.bad_words:
                    ban = sorted(set(ban).union(req.bans()))
                banned.append(ban)
                # the token this step samples; process() writes its value in place
                req.tokens.append(PLACEHOLDER)
        self.counters.batch_sizes_sum += len(seqs)
        self.counters.max_batch_size = max(self.counters.max_batch_size, len(seqs))
        sampling = [r for r, n in chunks if r.num_computed == len(r.tokens) - 1]
        if spec:  # one per sampling row (a verify chunk's grammar rows are filled by verify_chunk)
            owner = {r.request_id: r for r, _ in chunks}
            sampling = [owner[c.request_id] for c in seqs if c.sample for _ in range(c.num_draft + 1)]
            if drafted:
                self.deferred_masks[self.step_id] = sampling
                self.drafted[self.step_id] = (spec_masks, drafted)
                self.counters.masks_deferred += 1
                return Batch(self.step_id, seqs, params, hist, banned, masks_deferred=True, spec=True,
                             masks_await_drafts=True)
            if spec_masks:
                return Batch(self.step_id, seqs, params, hist, banned, self._spec_masks(sampling, spec_masks),
                             spec=True)
        if not any(r.grammar is not None for r in sampling):
            return Batch(self.step_id, seqs, params, hist, banned, spec=spec)
        if ahead:
            # the batch in flight will move these matchers: fill once its tokens are in
            self.deferred_masks[self.step_id] = sampling
            self.counters.masks_deferred += 1
            return Batch(self.step_id, seqs, params, hist, banned, masks_deferred=True, spec=spec)
        return Batch(self.step_id, seqs, params, hist, banned, self._grammar_masks(sampling), spec=spec)

    def _grammar_masks(self, sampling: Sequence[Request | None]) -> Any:
        from streamer.sampling.grammar import fill_bitmask

        # a request that ended meanwhile (stop, abort, grammar complete) samples unconstrained:
        # its token is dropped, and a terminated matcher has no mask to give
        states = [
            r.grammar
            if r is not None and r.grammar is not None and r.status == Status.RUNNING and not r.grammar.is_terminated()
            else None
            for r in sampling
        ]
        return fill_bitmask(states, self.vocab_size, pin=self.pin_masks)

    def _spec_masks(self, sampling: list[Request], rows: dict[int, Any]) -> Any:
        """The bitmask of a batch with grammar verify chunks: their rows as verify_chunk
        filled them, every other row from its matcher."""
        skip = {i for at, m in rows.items() for i in range(at, at + m.shape[0])}
        mask = self._grammar_masks([None if i in skip else r for i, r in enumerate(sampling)])
        for at, m in rows.items():
            mask[at : at + m.shape[0]] = m
        return mask

    def fill_deferred(self, step: int) -> MaskFill:
        """The bitmask of batch `step` (sent with masks_deferred), from the matchers as they
        are now: the step before it has been processed."""
        return MaskFill(step, self._grammar_masks(self.deferred_masks.pop(step)))

    def forget(self, step: int) -> None:
        """Step `step` is back: drop what its deferred masks would have needed (a step whose
        launch failed never asks)."""
        self.deferred_masks.pop(step, None)
        self.drafted.pop(step, None)

    def fill_drafted(self, step: int, drafts: dict[str, list[int]]) -> MaskFill:
        """The bitmask of batch `step` (sent with masks_await_drafts) now that the draft's
        proposals are known. Nothing was in flight when it was built (a grammar request gets
        no proposals in a batch built ahead), so every matcher is where the batch found it."""
        sampling = self.deferred_masks.pop(step)
        rows, drafted = self.drafted.pop(step)
        rows = dict(rows)
        for at, req in drafted.items():
            d = drafts.get(req.request_id)
            live = req.status == Status.RUNNING and req.grammar is not None and not req.grammar.is_terminated()
            if d is not None and live:
                rows[at] = drafted_rows(req.grammar, d, self.vocab_size)
            # (else: ended meanwhile; its rows sample unconstrained and their tokens are dropped)
        return MaskFill(step, self._spec_masks(sampling, rows))
