"""The scheduler's side of speculation: who gets proposals, and what a verified chunk leaves.

A verify chunk is the request's last token then its k proposals d1..dk; it samples at each
of its k + 1 positions, with the history each position would have had (the output so far,
then d1..dj: penalties and seeded draws see the same thing as without speculation). The
runner samples every position y0..yk as it would sample a plain decode; the request keeps
y0..ya, where a is the length of the longest prefix with yj == d(j+1). For greedy rows
that is the target's argmax run plus its next token; for sampled rows it is exact
rejection sampling of a point-mass draft (ngram proposes one token, q = 1 on it): dj is
kept with probability p(dj), and on rejection yj is distributed as p with dj taken out,
norm(max(0, p - q)). A seeded request draws the same uniform per output position with or
without speculation, so its output is the same either way.

Invariants:
  - proposals only for a request with no batch in flight and its last token known (the next
    proposals need this step's accepted tokens), not where prompt logprobs are due; with
    overlap scheduling a request with a verify chunk in flight is never scheduled ahead, and
    one whose proposals keep failing is scheduled ahead as plain decodes for a while
    (ahead_budget), then waits for its tokens to try again; with a grammar, only the
    proposals it allows (ngram), or (draft_model, whose proposals the scheduler learns only
    from the step that draws them) masks that keep nothing past the first it refuses;
  - draft_model and eagle3: the scheduler sends k PLACEHOLDERs; the runner's draft draws them
    (model/draft.py, model/eagle_draft.py), StepOutput.drafts brings them back, and the acceptance is the same
    comparison (a non-greedy row that rejected its proposal holds the redraw: never it);
  - the KV of the rejected proposals is never counted computed (`num_computed` covers the
    kept tokens only, so neither the radix tree nor a preemption's cache insert sees it),
    and the pages past the kept tokens are returned at once;
  - a stop token, max_tokens or the context ends a request inside an accepted run: nothing
    after the stopping token is output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamer.engine.request import PLACEHOLDER, Request, Status
from streamer.engine.spec.ngram import from_prediction, propose
from streamer.messages import SeqChunk
from streamer.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from collections import Counter

    from streamer.engine.scheduler.pages import Pages
    from streamer.engine.scheduler.stats import Counters


def proposals(cfg: SpeculativeConfig, req: Request, budget: int, max_model_len: int, in_flight: Counter[str],
              ahead: bool = False) -> list[int]:
    """The tokens to verify after req's last one this step (none: a plain decode). ahead: the
    batch is built while another is in flight (a grammar request then gets none: its rows'
    masks are filled once that batch is back, BatchBuilder's masks_deferred)."""
    p = req.params
    if (req.remaining != 1 or req.request_id in in_flight or (ahead and req.grammar is not None)
            or req.tokens[-1] == PLACEHOLDER or (p.prompt_logprobs_from is not None and req.num_output == 0)):
        return []
    # the kept run is at most k + 1 tokens: stay within max_tokens, the context and the budget
    k = min(cfg.num_speculative_tokens, p.max_tokens - req.num_output - 1,
            max_model_len - len(req.tokens) - 1, budget - 1)
    if k <= 0:
        return []
    if cfg.drafted:
        # the runner's draft draws them (model/draft.py); under a grammar, the rows' masks
        # follow from the draws (Batch.masks_await_drafts, drafted_masks)
        return [PLACEHOLDER] * k
    if req.prediction is not None:
        draft, req.prediction_at = from_prediction(req.output, req.prediction, req.prediction_at, k,
                                                   cfg.prompt_lookup_max)
        if draft:
            return draft
    return propose(req.tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)


def ahead_budget(misses: int) -> int:
    """With overlap scheduling: after `misses` proposal attempts in a row that found nothing,
    how many of a request's next steps are scheduled ahead as plain decodes before it waits
    for its tokens to look again (doubling, up to 16: a request whose output never repeats
    its input loses little of the overlap, one that starts to repeat soon gets proposals)."""
    return 0 if misses <= 0 else min(1 << (misses - 1), 16)


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many proposals the verify step kept: the longest prefix where each sampled token
    is the proposal it checked (sampled has one more entry: the token after the last)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


def count(counters: Counters, drafts: int, kept: int) -> None:
    counters.spec_verifies += 1
    counters.spec_draft_tokens += drafts
    counters.spec_accepted_tokens += kept
    pos = counters.spec_accepted_per_position
    if len(pos) < drafts:
        pos.extend([0] * (drafts - len(pos)))
    for j in range(kept):
        pos[j] += 1


def roll_back(pages: Pages, req: Request, in_flight: Counter[str]) -> None:
    """After a verify step: give back the pages past req's tokens (they held only rejected
    proposals' KV). Nothing else holds them: req is in no batch in flight."""
    if req.status != Status.RUNNING:
        return
    assert req.request_id not in in_flight, "a speculating request has a batch in flight"
    keep = pages.pool.pages_for(len(req.tokens))
    if len(req.pages) > keep:
        pages.pool.decref(req.pages[keep:])
        del req.pages[keep:]


def verify_chunk(
    req: Request, pool_pages_for: Callable[[int], int], vocab_size: int
) -> tuple[SeqChunk, list[list[int]], list[list[int]], Any]:
    """req's verify chunk (its last token, then req.draft), the histories and bans of its
    k + 1 sampling rows, and with a grammar their bitmask rows (None without). Counts the last
    token computed at once (the proposals are counted when kept, results.process) and
    appends the PLACEHOLDER of the first token to come."""
    draft, req.draft = req.draft, []
    masks = None
    if req.grammar is not None and PLACEHOLDER not in draft:  # (draft_model's: drafted_masks, once drawn)
        draft, masks = _grammar_rows(req.grammar, draft, vocab_size)
    start = req.num_computed
    k = len(draft)
    chunk = SeqChunk(req.request_id, [req.tokens[start], *draft], start, req.pages[: pool_pages_for(start + 1 + k)],
                     True, num_draft=k, lora=req.params.lora)
    p = req.params
    needed = p.reads_history
    out = req.output
    hist = [out + draft[:j] if needed else [] for j in range(k + 1)]
    ban = sorted(req.eos_token_ids | set(p.stop_token_ids))
    # row j samples output token num_output + j: EOS stays banned there before min_tokens
    banned = [ban if req.num_output + j < p.min_tokens else [] for j in range(k + 1)]
    if req.bad_words:  # (row j follows the output and the first j proposals)
        banned = [sorted(set(b).union(req.bans(out + draft[:j]))) for j, b in enumerate(banned)]
    req.num_computed = start + 1
    req.tokens.append(PLACEHOLDER)
    req.verifying = True  # (until results.process has its rows)
    return chunk, hist, banned, masks


def drafted_rows(grammar: Any, draft: list[int], vocab_size: int) -> Any:
    """The bitmask rows of a verify chunk whose proposals the draft drew unconstrained (its
    k + 1 rows, as _grammar_rows'). Past the first proposal the grammar refuses (or one that
    ends it) the rows are unconstrained: the row before already masks that proposal out, so
    the verify keeps nothing after it (greedy: the masked argmax is another token; sampled:
    p(d) = 0, so rejection redraws from norm(max(0, p - q)), which leaves the output
    distributed as the masked p)."""
    import torch

    from streamer.sampling.grammar import fill_bitmask

    rows = _walk(grammar, draft, vocab_size)
    rows.extend(fill_bitmask([None], vocab_size) for _ in range(len(draft) + 1 - len(rows)))
    return torch.cat(rows)


def _grammar_rows(grammar: Any, draft: list[int], vocab_size: int) -> tuple[list[int], Any]:
    """The proposals the grammar allows (the longest such prefix, short of one that ends it:
    a terminated matcher has no next mask), and the bitmask of each row."""
    import torch

    rows = _walk(grammar, draft, vocab_size)
    return draft[: len(rows) - 1], torch.cat(rows)


def _walk(grammar: Any, draft: list[int], vocab_size: int) -> list[Any]:
    """Row j's bitmask is the mask after d1..dj, for j up to the first proposal the grammar
    refuses or the one that ends it. The matcher is rolled back to where it was:
    results.process moves it by the kept tokens only."""
    from streamer.sampling.grammar import fill_bitmask

    rows = [fill_bitmask([grammar], vocab_size)]
    moved = 0
    for t in draft:
        if not grammar.accept(t):
            grammar.rejected = False  # (a refused proposal is just not kept)
            break
        moved += 1
        if grammar.is_terminated():
            break
        rows.append(fill_bitmask([grammar], vocab_size))
    grammar.rollback(moved)
    return rows
