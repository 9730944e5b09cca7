"""Rejection sampling of a draft model's proposals (speculative decoding, model/draft.py).

A draft proposes d ~ q (its own processed distribution); the target's processed
distribution at the same position is p. d is kept with probability min(1, p(d) / q(d));
on rejection the token is drawn from norm(max(0, p - q)), and no later proposal of the
run is looked at. Whatever q is, each kept or redrawn token is distributed exactly as p
(the classic speculative sampling argument: P(y) = min(p, q)(y) + max(0, p - q)(y) = p(y)).

"Processed" is the sampler's one definition (sampler.py): logit_bias, penalties, the
grammar's bitmask (the target's rows only: the draft draws unconstrained, and a proposal the
grammar refuses has p = 0, so it is never kept), bans, then temperature, top-k, top-p and min-p. Greedy rows are point masses on the argmax, for
the draft and the target alike, so a greedy proposal is kept exactly when it is the
target's argmax: the acceptance rule needs no case of its own.

Random numbers: a seeded request takes every uniform from a hash of (its seed, a stream,
its output position), as the plain sampler does (draw.draw_uniform): the draft's draw,
the acceptance test and the redraw are three streams, so a seed reproduces its output
whatever shares the batch. Unseeded rows take torch's global CPU generator.
"""

from __future__ import annotations

import torch

from streamer.messages import SamplingParams
from streamer.sampling.draw import MIN_TEMPERATURE, draw_uniform, filtered_probs, inverse_cdf
from streamer.sampling.processing import LOGIT_MAX, BiasCache, bias_and_penalties, edits_logits, mask_and_ban

DRAFT_STREAM = 0x5DEECE66D
"""Seed offsets of the draft's draws and of the acceptance tests (the redraw and the
token after the last proposal use the plain stream: offset 0)."""
ACCEPT_STREAM = 0x2545F4914F6CDD1D


def processed_logits(
    logits: torch.Tensor, params: list[SamplingParams], hist: list[list[int]], banned: list[list[int]], biases: BiasCache,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [rows, V]: logit_bias, penalties, the grammar bitmask (a row each, or None) and
    bans applied (what reported logprobs are the log_softmax of)."""
    logits = logits.float().clone()
    if any(edits_logits(p) for p in params):
        bias_and_penalties(logits, params, hist, biases)
        logits.nan_to_num_(nan=float("-inf"), posinf=LOGIT_MAX, neginf=float("-inf")).clamp_(max=LOGIT_MAX)
    mask_and_ban(logits, banned, bitmask, None)
    return logits


def probs_of(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float32 [rows, V]: the distribution each row of processed logits draws from, after
    temperature, top-k, top-p and min-p (a greedy row: its argmax)."""
    n, v = logits.shape
    out = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        out[g] = torch.nn.functional.one_hot(logits[g].argmax(-1), v).float()
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        d = torch.tensor(drawn, device=logits.device)
        dev = logits.device
        temp = torch.tensor([max(params[i].temperature, MIN_TEMPERATURE) for i in drawn], device=dev)
        top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < v else v for i in drawn], device=dev)
        top_p = torch.tensor([params[i].top_p for i in drawn], device=dev)
        min_p = torch.tensor([params[i].min_p for i in drawn], device=dev)
        out[d] = filtered_probs(logits[d] / temp[:, None], top_k, top_p, min_p)
    return out


def processed_probs(
    logits: torch.Tensor, params: list[SamplingParams], hist: list[list[int]], banned: list[list[int]], biases: BiasCache
) -> torch.Tensor:
    """float32 [rows, V]: the distribution each row draws from (a greedy row: its argmax)."""
    return probs_of(processed_logits(logits, params, hist, banned, biases), params)


def uniforms(params: list[SamplingParams], positions: list[int], stream: int) -> torch.Tensor:
    """float64 [rows]: one uniform per row (a seeded row's from its seed, stream and output
    position; the others from torch's CPU generator)."""
    u = torch.rand(len(params), dtype=torch.float64)
    for i, p in enumerate(params):
        if p.seed is not None:
            u[i] = draw_uniform((p.seed + stream) & ((1 << 63) - 1), positions[i])
    return u


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (inverse CDF at u)."""
    return inverse_cdf(probs, u.to(probs.device))


def accept_or_redraw(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_redraw: torch.Tensor
) -> torch.Tensor:
    """Per row: the draft token when kept, else a draw from norm(max(0, p - q)) (never the
    draft token then: rejection needs p(d) < q(d)). p, q [rows, V]; drafts, u_* [rows]."""
    rows = torch.arange(p.shape[0], device=p.device)
    pd, qd = p[rows, drafts], q[rows, drafts]
    keep = u_accept.to(p.device) * qd < pd
    residual = (p - q).clamp_(min=0.0)
    # (p == q up to rounding: nothing left to redraw from; p itself is then the answer)
    empty = residual.sum(-1, keepdim=True) <= 0
    redrawn = draw(torch.where(empty, p, residual), u_redraw)
    return torch.where(keep, drafts, redrawn)
