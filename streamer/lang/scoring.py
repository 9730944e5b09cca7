"""select: score each choice by its log-likelihood after the text, in one batched prefill.

For prefix text P and choices c_1..c_n:

  1. tokenize P and every P + c_i (one call);
  2. k = the shortest common prefix of tok(P) with any tok(P + c_i). Usually
     k = len(tok(P)); when a choice merges with the end of P into one token
     (P ends in " ", c_i starts with a letter), k steps back so that every
     choice is scored from the same position, over the same context tok(P)[:k];
  3. one request per choice, all submitted at once (the scheduler batches
     them): prompt tok(P + c_i), max_tokens=1, prompt_logprobs_from=k. The
     engine returns the logprob of each prompt token from k on, computed in
     the prefill; the radix cache serves the shared tokens before k;
  4. score_i = sum of those logprobs = log p(tok(P + c_i)[k:] | tok(P)[:k]),
     the log-likelihood of the choice (plus any re-tokenized tail of P, the
     same text for every choice). normalize=True uses the mean per token instead.

No token is sampled for the decision: the one token each request draws is
discarded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from streamer.messages import SamplingParams


@dataclass(frozen=True, slots=True)
class Scores:
    logprobs: list[float]
    """Sum of the scored tokens' logprobs, per choice."""
    tokens: list[int]
    """Number of tokens scored, per choice."""
    cached_tokens: list[int]
    start: int
    """k: the first prompt position scored."""

    def best(self, normalize: bool) -> int:
        vals = self.normalized if normalize else self.logprobs
        return max(range(len(vals)), key=vals.__getitem__)

    @property
    def normalized(self) -> list[float]:
        return [lp / n if n else 0.0 for lp, n in zip(self.logprobs, self.tokens)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def score(backend, prefix: str, choices: list[str] | tuple[str, ...], commit: bool = True) -> Scores:
    ids = await backend.tokenize([prefix, *(prefix + c for c in choices)])
    base, full = ids[0], ids[1:]
    # position 0 has no logprob (nothing precedes it): score from 1 at the earliest
    k = max(1, min(common_prefix(base, f) for f in full))
    if commit and len(full) > 1 and k > 1:
        await backend.complete(base[:k], SamplingParams(max_tokens=1, temperature=0.0))

    async def one(f: list[int]) -> tuple[float, int, int]:
        if len(f) <= k:
            return 0.0, 0, 0  # an empty choice adds no token
        out = await backend.complete(f, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs_from=k))
        lps = out.prompt_logprobs or []
        if len(lps) != len(f) - k:
            raise RuntimeError(f"the backend returned {len(lps)} prompt logprobs, expected {len(f) - k}")
        return float(sum(lps)), len(lps), out.cached_tokens

    results = await asyncio.gather(*(one(f) for f in full))
    return Scores([r[0] for r in results], [r[1] for r in results], [r[2] for r in results], k)
