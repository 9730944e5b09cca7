"""Rejection sampling of a draft model's proposals (sampling/rejection.py): whatever the
draft's distribution, the tokens that come out are distributed as the target's."""

from __future__ import annotations

from collections import OrderedDict

import torch

from streamer.messages import SamplingParams
from streamer.sampling.draw import MIN_TEMPERATURE, filtered_probs
from streamer.sampling.rejection import accept_or_redraw, draw, processed_probs, uniforms
from tests.stats import chi2

V = 8
CHI2_DF7_P999 = 24.32  # the 99.9% quantile of chi-square with 7 degrees of freedom


def test_kept_and_redrawn_tokens_follow_the_target_with_a_deliberately_wrong_draft():
    torch.manual_seed(0)
    n = 40_000
    p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0])
    q = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.10, 0.20, 0.20, 0.30])  # mass where p has none
    P, Q = p.expand(n, V).contiguous(), q.expand(n, V).contiguous()
    d = draw(Q, torch.rand(n, dtype=torch.float64))
    y = accept_or_redraw(P, Q, d, torch.rand(n, dtype=torch.float64), torch.rand(n, dtype=torch.float64))
    assert chi2(torch.bincount(y, minlength=V).double(), p.double()) < CHI2_DF7_P999
    kept = (y == d).double().mean().item()
    assert abs(kept - torch.minimum(p, q).sum().item()) < 0.01, "kept with probability sum(min(p, q))"
    assert not (y[d == 7] == 7).any(), "a proposal the target cannot draw is never kept"


def test_a_draft_equal_to_the_target_is_always_kept_and_a_greedy_one_exactly_at_the_argmax():
    n = 1000
    p = torch.softmax(torch.randn(V), -1).expand(n, V).contiguous()
    d = draw(p, torch.rand(n, dtype=torch.float64))
    u = torch.rand(n, dtype=torch.float64)
    assert torch.equal(accept_or_redraw(p, p, d, u, u), d)
    one_hot = torch.nn.functional.one_hot(torch.arange(n) % V, V).float()
    best = torch.nn.functional.one_hot(torch.full((n,), 3), V).float()
    y = accept_or_redraw(best, one_hot, torch.arange(n) % V, u, u)
    assert (y == 3).all(), "greedy: the argmax, whether the proposal was it or not"


def test_processed_probs_are_the_samplers_distribution():
    logits = torch.randn(3, V) * 3
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, logit_bias={2: 5.0}, presence_penalty=0.5)]
    hist = [[], [], [1, 1, 4]]
    got = processed_probs(logits, params, hist, [[], [], [0]], OrderedDict())
    p0 = params[0]
    want0 = filtered_probs(logits[:1] / p0.temperature, torch.tensor([4]), torch.tensor([0.9]), torch.tensor([0.05]))
    assert torch.allclose(got[0], want0[0], atol=1e-6)
    assert torch.equal(got[1], torch.nn.functional.one_hot(logits[1].argmax(), V).float())
    x = logits[2].clone()
    x[2] += 5.0
    x[[1, 4]] -= 0.5
    x[0] = float("-inf")
    assert torch.allclose(got[2], torch.softmax(x / max(1.3, MIN_TEMPERATURE), -1), atol=1e-6)


def test_seeded_uniforms_depend_on_seed_stream_and_position_only():
    a = SamplingParams(temperature=1.0, seed=7)
    u1 = uniforms([a, SamplingParams(temperature=1.0)], [3, 3], stream=11)
    u2 = uniforms([SamplingParams(temperature=1.0), a], [0, 3], stream=11)
    assert u1[0] == u2[1]
    assert uniforms([a], [3], stream=12)[0] != u1[0]
    assert uniforms([a], [4], stream=11)[0] != u1[0]
