"""Acceptance of proposals (spec/rollback.py) with the engine's own sampler: the kept tokens
are distributed as the target's, however wrong the draft; seeded rows reproduce."""

from __future__ import annotations

import torch

from streamer.engine.spec.rollback import accepted
from streamer.messages import SamplingParams
from streamer.sampling.draw import MIN_TEMPERATURE, filtered_probs
from streamer.sampling.sampler import SampleInputs, Sampler
from tests.stats import chi2

V = 8


def target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits[None] / max(p.temperature, MIN_TEMPERATURE)
    k = p.top_k if 0 < p.top_k < V else V
    return filtered_probs(x, torch.tensor([k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]


def verify(logits0, logits1, draft, params, n, seeds=None):
    """n independent verify chunks of one proposal: rows (position 0, position 1) each."""
    rows = torch.stack([logits0, logits1] * n)
    ps = [params if seeds is None else SamplingParams(**{**_fields(params), "seed": seeds[i // 2]})
          for i in range(2 * n)]
    hist = [[5] * 3 + [draft] * (i % 2) for i in range(2 * n)]  # (position j: the output + draft[:j])
    out = Sampler(V, torch.device("cpu")).sample(rows, SampleInputs(ps, hist, [[]] * (2 * n)))
    assert isinstance(out, torch.Tensor)
    ys = out.view(n, 2).tolist()
    return [y[: accepted([draft], y) + 1] for y in ys]


def _fields(p):
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_kept_tokens_follow_the_target_distribution_with_a_wrong_draft():
    torch.manual_seed(0)
    logits0 = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0, 0.0, 0.5])
    logits1 = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.5, -2.0, 0.3, 0.1])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    draft = 3  # unlikely under p0: mostly rejected, then the residual must be p0 without it
    n = 20000
    kept = verify(logits0, logits1, draft, params, n)
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=V).double()
    p0 = target(logits0, params).double()
    # chi-square, 99.9% quantile of 5 degrees of freedom (6 tokens in the support) = 20.5
    assert chi2(first, p0) < 20.5
    assert abs(first[draft] / n - p0[draft]) < 0.01, "the draft is kept with probability p(draft)"
    assert all(len(k) == 1 for k in kept if k[0] != draft), "nothing follows a rejected draft"
    after = torch.bincount(torch.tensor([k[1] for k in kept if len(k) == 2]), minlength=V).double()
    assert after.sum() > 500
    assert chi2(after, target(logits1, params).double()) < 20.5  # after a kept draft: p1


def test_seeded_chunks_reproduce_and_match_plain_seeded_draws():
    logits0 = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    params = SamplingParams(temperature=1.0)
    seeds = list(range(300))
    a = verify(logits0, logits0, 2, params, 300, seeds)
    b = verify(logits0, logits0, 2, params, 300, seeds)
    assert a == b
    # the first kept token is the draw a plain decode would make at that position
    plain = Sampler(V, torch.device("cpu")).sample(
        torch.stack([logits0] * 300),
        SampleInputs([SamplingParams(temperature=1.0, seed=s) for s in seeds], [[5] * 3] * 300, [[]] * 300))
    assert [k[0] for k in a] == plain.tolist()
    assert 0 < sum(len(k) == 2 for k in a) < 300
