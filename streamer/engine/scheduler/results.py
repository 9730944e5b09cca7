"""Step results: a StepOutput in, TokenDeltas out.

process() writes each sampled token over its PLACEHOLDER, ends the requests it stops
(stop token, max_tokens, the context, a grammar that is complete or refused the token),
caches a freshly prefilled prompt, releases the pages behind a sliding window (Pages.trim)
and the pages that were waiting for the batch (Pages.returned). A failed step of several requests sends each back to the queue to run
alone (Pages.retry_later); a request that fails alone fails.

Jump-forward: after process(), the requests in `Scheduler.jumps` may have text their
grammar forces next. The actor loop finds it in a thread (compute_jumps: matcher work,
bounded, but not for the event loop) and waits for it before anything else touches the
scheduler; apply_jumps then appends the tokens, which the next step computes as one
multi-token chunk. Not for requests that want logprobs (a forced token has no sampled
distribution to report).

Invariant: a request that ends while a batch in flight holds it is retired at once (its
final delta goes out), but its pages wait for that batch's StepOutput (Pages.leave, then
Pages.returned here).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from streamer.engine.request import Request, Status
from streamer.engine.spec.rollback import accepted, count, roll_back
from streamer.messages import Batch, SampledToken, SeqChunk, StepOutput, TokenDelta

if TYPE_CHECKING:
    from streamer.engine.scheduler.policy import Scheduler

log = logging.getLogger("streamer.scheduler")


def process(sched: Scheduler, batch: Batch, out: StepOutput) -> list[TokenDelta]:
    deltas: list[TokenDelta] = []
    counters, in_flight, requests, pages = sched.counters, sched.in_flight, sched.requests, sched.pages
    counters.device_busy_s += out.device_time - out.mask_wait
    built_ahead = sched.batches.built_ahead
    ahead = batch.step in built_ahead
    if ahead:  # (before a batch built with none in flight, the device may just have had no work)
        built_ahead.discard(batch.step)
        counters.device_idle_s += out.idle_before
    counters.device_idle_s += out.mask_wait
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
            counters.isolated_failures += 1
            log.warning("step %d failed with %d requests; each runs alone next: %s",
                        batch.step, len(batch.seqs), out.error)
    for seq in batch.seqs:
        in_flight[seq.request_id] -= 1
        if in_flight[seq.request_id] <= 0:
            del in_flight[seq.request_id]
        req = requests.get(seq.request_id)
        if req is not None and seq.num_draft:
            req.verifying = False
        tok = next(sampled) if seq.sample and out.error is None else None
        more = [next(sampled) for _ in range(seq.num_draft)] if seq.num_draft and tok is not None else None
        if req is None or req.status != Status.RUNNING:
            continue
        if out.error is not None:
            if isolate and not req.suspect:
                pages.retry_later(req, seq.start)
            else:
                deltas.append(sched.retire(req, "error", error=out.error))
            continue
        if seq.request_id in out.prompt_logprobs:
            req.prompt_logprobs.extend(out.prompt_logprobs[seq.request_id])
            req.prompt_top_logprobs.extend(out.prompt_top_logprobs.get(seq.request_id, ()))
            req.prompt_ranks.extend(out.prompt_ranks.get(seq.request_id, ()))
        if tok is None:
            continue
        req.suspect = False  # it sampled alone without failing: batched again from now
        if req.params.embed:  # its prompt's embedding is the answer: the token sampled is dropped
            del req.tokens[req.prompt_len :]
            d = sched.retire(req, "stop")
            d.embedding = out.embeddings.get(seq.request_id)
            if d.embedding is None:
                d.finish_reason, d.error = "error", "internal error: the step computed no embedding"
            deltas.append(d)
            continue
        if more is not None:
            deltas.append(verified(sched, req, seq, [tok, *more], out.drafts.get(seq.request_id)))
            continue
        at = seq.start + len(seq.token_ids)
        req.tokens[at] = tok.token_id
        counters.generated_tokens_total += 1
        if at == req.prompt_len and sched.config.enable_prefix_caching:
            pages.cache_prompt(req)
        reason = stop_reason(req, tok.token_id, at + 1, sched.max_model_len)
        if reason is not None:
            del req.tokens[at + 1 :]  # placeholders of batches still in flight
        logprobs = [tok] if req.params.logprobs is not None else None
        new = [tok.token_id]
        if reason is None:
            d = delta(req, new, logprobs)
            deltas.append(d)
            if may_jump(sched, req):
                sched.jumps.append((req, d))
        else:
            error = grammar_error(req, sched.vocab_size) if reason == "error" else None
            d = sched.retire(req, reason, error=error)
            if error is None:  # a token the grammar refused is not output
                d.token_ids, d.logprobs = new, logprobs
            deltas.append(d)
    if pages.window:
        for seq in batch.seqs:  # (after cache_prompt: a prompt goes to the tree before it is trimmed)
            req = requests.get(seq.request_id)
            if req is not None and req.status == Status.RUNNING:
                pages.trim(req, req.num_computed if seq.num_draft else seq.start + len(seq.token_ids))
    # KV efficiency: of the slots in pages held by running requests, how many hold tokens
    ps = sched.pool.page_size
    counters.kv_live += sum(r.num_computed - r.released * ps for r in sched.running)
    counters.kv_slots += sum(len(r.pages) - r.released for r in sched.running) * ps
    pages.returned(in_flight)
    sched.diagnostics.on_step(batch, out, ahead, t_begin, c_begin)
    return deltas


def verified(sched: Scheduler, req: Request, seq: SeqChunk, toks: list[SampledToken],
             drawn: list[int] | None = None) -> TokenDelta:
    """A verify chunk's rows in (spec/rollback.py): the kept run written, up to the token that
    ends req if one does; the pages of the rejected proposals returned. Its delta. drawn:
    the proposals a draft model drew for the chunk's PLACEHOLDERs (StepOutput.drafts)."""
    drafts = drawn if drawn is not None else seq.token_ids[1:]
    kept = accepted(drafts, [t.token_id for t in toks])
    count(sched.counters, len(drafts), kept)
    at = seq.start + 1  # (the PLACEHOLDER of the first token)
    new: list[SampledToken] = []
    reason = None
    jumps = may_jump(sched, req)
    for t in toks[: kept + 1]:
        if new:
            req.tokens.append(t.token_id)
        else:
            req.tokens[at] = t.token_id
        new.append(t)
        if at == req.prompt_len and len(new) == 1 and sched.config.enable_prefix_caching:
            sched.pages.cache_prompt(req)
        reason = stop_reason(req, t.token_id, at + len(new), sched.max_model_len)
        if reason is not None:
            break  # nothing after the stopping token is output
        if jumps and len(new) <= kept and req.grammar.jump_forward_string(4):  # type: ignore[union-attr]
            # the grammar forces text from here: plain decoding would jump forward now (after
            # this step, compute_jumps), not sample the rows after; so the run ends here
            # (4 bytes: enough for the first whole character of the forced text)
            break
    # KV is computed for the last token and the kept proposals before the newest token
    req.num_computed = at + len(new) - 1
    sched.counters.generated_tokens_total += len(new)
    logprobs = new if req.params.logprobs is not None else None
    ids = [t.token_id for t in new]
    if reason is None:
        roll_back(sched.pages, req, sched.in_flight)
        d = delta(req, ids, logprobs)
        if jumps:
            sched.jumps.append((req, d))
        return d
    error = grammar_error(req, sched.vocab_size) if reason == "error" else None
    d = sched.retire(req, reason, error=error)
    if error is None:
        d.token_ids, d.logprobs = ids, logprobs
    else:  # a token the grammar refused is not output
        d.token_ids, d.logprobs = ids[:-1], None if logprobs is None else logprobs[:-1]
    return d


def may_jump(sched: Scheduler, req: Request) -> bool:
    """Whether req's grammar may jump forward after a step (not with logprobs: a forced token
    has no sampled distribution to report)."""
    return req.grammar is not None and sched.jump_forward and req.params.logprobs is None


def stop_reason(req: Request, token: int, length: int, max_model_len: int) -> str | None:
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
    if num_output >= p.max_tokens or length >= max_model_len:
        return "length"
    return None


def grammar_error(req: Request, vocab_size: int) -> str:
    """Why req's grammar refused its sampled token. The usual cause: from here the grammar
    admits no token of this model's vocabulary (a character no token sequence spells, say),
    so every logit was masked; a user's constraint, not an engine failure."""
    from streamer.sampling.grammar import fill_bitmask

    assert req.grammar is not None
    if vocab_size and not bool(fill_bitmask([req.grammar], vocab_size).any()):
        return (f"the grammar admits no token of this model's vocabulary after {req.grammar.num_accepted} "
                "output token(s): the constraint cannot be met with this tokenizer")
    return "internal error: the sampled token is not allowed by the grammar"


def compute_jumps(jumps: list[tuple[Request, TokenDelta]], max_model_len: int) -> list[list[int]]:
    """The forced tokens of each request in `jumps` (already accepted by its matcher), at
    most what its max_tokens and the context leave. Touches only those matchers."""
    from streamer.sampling.grammar import JUMP_MAX_BYTES, JUMP_STEP_BYTES

    out = []
    budget = JUMP_STEP_BYTES  # (once spent, the others jump after the next step)
    for req, _ in jumps:
        assert req.grammar is not None
        limit = min(req.params.max_tokens - req.num_output, max_model_len - len(req.tokens))
        toks = req.grammar.jump_forward(limit, min(JUMP_MAX_BYTES, budget))
        budget -= req.grammar.jump_bytes + 1
        out.append(toks)
    return out


def apply_jumps(sched: Scheduler, forced: list[list[int]]) -> list[TokenDelta]:
    """Append compute_jumps' tokens to their requests and deltas; the deltas of requests
    that a forced token ends (a stop token, max_tokens, the context)."""
    ended: list[TokenDelta] = []
    counters = sched.counters
    for (req, d), toks in zip(sched.jumps, forced):
        p = req.params
        reason = None
        for t in toks:
            req.tokens.append(t)
            d.token_ids.append(t)
            counters.generated_tokens_total += 1
            counters.jump_forward_tokens += 1
            if req.num_output >= p.min_tokens and (
                t in p.stop_token_ids or (not p.ignore_eos and t in req.eos_token_ids)
            ):
                reason = "stop"
                break
        if reason is None and (req.num_output >= p.max_tokens or len(req.tokens) >= sched.max_model_len):
            reason = "length"
        if reason is not None:
            ended.append(sched.retire(req, reason))
    sched.jumps = []
    return ended


def delta(req: Request, tokens: list[int], logprobs: Any = None) -> TokenDelta:
    """A TokenDelta of req; its first carries the prompt's numbers (and prompt logprobs)."""
    d = TokenDelta(req.request_id, tokens, logprobs)
    if not req.sent_prompt_info:
        req.sent_prompt_info = True
        d.prompt_tokens, d.cached_tokens = req.prompt_len, req.cached_tokens
        d.queue_time = req.queue_time
        d.cached_host_tokens = req.cached_host_tokens
        if req.prediction is not None:
            d.prediction_token_ids = req.prediction.tolist()
        if req.params.prompt_logprobs_from is not None:
            d.prompt_logprobs = req.prompt_logprobs
            d.prompt_token_ids = req.tokens[: req.prompt_len]
            d.prompt_ranks = req.prompt_ranks
            if req.params.prompt_top_logprobs:
                d.prompt_top_logprobs = req.prompt_top_logprobs
    return d
