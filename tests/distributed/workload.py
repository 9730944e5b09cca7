"""One workload that a tensor-parallel engine and an engine of one rank must answer alike:
a batch mixing a cached prefix, prompts longer than the step budget (chunked prefill) and,
in a pool too small for all of them at once, preemption; prompt logprobs on every prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass

from streamer import LLM, SamplingParams
from streamer.model.tp_group import COUNTS

ENGINE = dict(num_pages=24, page_size=16, max_num_batched_tokens=48, max_num_seqs=8)
"""Chunks of at most 48 tokens; 23 pages of 16 tokens for 6 requests of ~100 + 24 tokens
(~8 pages each): the scheduler preempts."""


@dataclass
class Answers:
    tokens: list[list[int]]
    prompt_logprobs: list[list[float]]
    cached: list[int]
    preemptions: int


def text_ids(llm: LLM) -> list[int]:
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type, oil-based inks and a wooden press. Books became cheaper, literacy "
            "spread, and ideas travelled faster than ever before across Europe and the world. ") * 8
    return llm.tokenizer(text)["input_ids"]


def run(llm: LLM) -> Answers:
    ids = text_ids(llm)
    rng = random.Random(3)
    prefix = ids[:40]
    llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))  # the prefix, cached
    prompts = [prefix + ids[200 + 17 * i : 230 + 17 * i] for i in range(2)]
    for _ in range(4):
        n = rng.randint(70, 110)
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start : start + n])
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs_from=len(prefix))] * 2 \
        + [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs_from=1)] * 4
    outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return Answers([o.token_ids for o in outs], [o.prompt_logprobs or [] for o in outs],
                   [o.cached_tokens for o in outs], llm.stats().preemptions)


def assert_same(tp: Answers, one: Answers) -> None:
    assert tp.tokens == one.tokens, "greedy output is that of one rank"
    assert tp.preemptions > 0 and all(c >= 32 for c in tp.cached[:2]), "the workload preempted and hit the cache"
    for a, b in zip(tp.prompt_logprobs, one.prompt_logprobs):
        assert len(a) == len(b) > 0
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def collectives_of_one_step(llm: LLM) -> dict[str, int]:
    """The collectives rank 0 issued for a lone one-token step (a short prompt, one token)."""
    before = dict(COUNTS)
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, temperature=0))
    assert out.error is None
    return {k: v - before.get(k, 0) for k, v in COUNTS.items() if v - before.get(k, 0)}


def assert_follows_until_near_tie(got: list, ref: list, bound: float = 5e-2, min_agreed: float = 0.5) -> int:
    """bf16 outputs (RequestOutputs with logprobs=5) of two engines whose sums run in another
    order (an all-reduce over ranks, another GEMM split): greedy tokens agree until the
    reference's top tokens are within `bound` of each other, where the other engine may take a
    runner-up (then the continuations part, and comparing stops); wherever they agree, the
    logprobs of the tokens in both top-5s are within `bound`. Returns the positions compared,
    which must be at least `min_agreed` of all (random models fall into exact ties early)."""
    compared = total = 0
    for a, b in zip(got, ref, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        total += len(b.token_ids)
        for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            mine, theirs = dict(a.logprobs[i].top_logprobs), dict(b.logprobs[i].top_logprobs)
            if s != t:
                assert s in theirs and theirs[t] - theirs[s] <= bound, (a.request_id, i, s, t, theirs)
                break
            for tok in mine.keys() & theirs.keys():
                assert abs(mine[tok] - theirs[tok]) <= bound, (a.request_id, i, tok, mine[tok], theirs[tok])
            compared += 1
    assert compared >= min_agreed * total, (compared, total)
    return compared

