"""The draw from the processed distribution, and the logprobs packaged with it.

A draw is an inverse-CDF lookup: one uniform u per row, the first token whose
cumulative probability exceeds u (float64 cumsum), after temperature, top-k, top-p
and min-p (see sampler.py). Its per-row inputs (`DrawInputs`) depend only on the
parameters, the histories and the random numbers, so they are uploaded when a step
is planned, before its logits are final.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from streamer.messages import SampledToken, SamplingParams
from streamer.sampling.processing import upload, upload_ids

MIN_TEMPERATURE = 1e-6
"""A positive temperature below this is treated as this (1e-300 is 0 in float32)."""
TOP_CANDIDATES = 256
"""Candidate set of top-k / top-p rows (more only when a row's top_k is larger)."""


@dataclass
class DrawInputs:
    """The draw's per-row inputs, uploaded before the logits are final (Sampler.plan)."""

    n: int
    rows: list[int]
    """Rows that draw (temperature > 0); the others take the argmax."""
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)
    """Positions in `rows` without top-k / top-p (a draw from the whole distribution)."""
    filt: list[int] = field(default_factory=list)
    plain_min_p: bool = False
    u: Any = None
    """float64 [len(rows)]: the uniforms of the draws."""
    temp: Any = None
    min_p_plain: Any = None
    rows_t: Any = None
    plain_t: Any = None
    filt_t: Any = None
    kernel: Any = None
    """float64 [4, n] on the device when the whole draw runs as kernels.sampling.draw: per row
    u, temperature (0 = argmax), min_p and 1.0 where the grammar bitmask applies."""
    kernel_min_p: bool = False
    kernel_masked: bool = False
    """Some row has a grammar (the kernel reads the bitmask)."""


_M64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """A 63-bit hash of (seed, position) (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def draw_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of a seeded request's draw number `position`."""
    return (draw_seed(seed, position) >> 10) * 2.0**-53


def uniforms(params: list[SamplingParams], hist: list[list[int]], rows: list[int]) -> list[float]:
    """The uniforms of the drawing rows: torch's CPU generator, or a seeded row's own
    (draw_uniform at its number of output tokens)."""
    u = torch.rand(len(rows), dtype=torch.float64).tolist() if rows else []
    for j, i in enumerate(rows):
        seed = params[i].seed
        if seed is not None:
            u[j] = draw_uniform(seed, len(hist[i]) if i < len(hist) else 0)
    return u


def draw_inputs(logits: torch.Tensor, params: list[SamplingParams], hist: list[list[int]]) -> DrawInputs:
    """The per-row inputs of the draw, on the device (they do not depend on the logits'
    values: only on the parameters, the histories and the random numbers)."""
    n, v = logits.shape
    dev = logits.device
    rows = [i for i, p in enumerate(params) if not p.greedy]
    d = DrawInputs(n, rows)
    if not rows:
        return d
    u = uniforms(params, hist, rows)
    top_k = [params[i].top_k if 0 < params[i].top_k < v else v for i in rows]
    d.top_p = [params[i].top_p for i in rows]
    d.min_p = [params[i].min_p for i in rows]
    d.top_k = top_k
    d.filt = [j for j in range(len(rows)) if top_k[j] < v or d.top_p[j] < 1.0]
    d.plain = [j for j in range(len(rows)) if top_k[j] == v and d.top_p[j] >= 1.0]
    # one upload for every float input (uniforms, temperatures, min-p of plain rows) and
    # one for every index list: each host-to-device copy costs the host ~20 us
    mp = [d.min_p[j] for j in d.plain]
    d.plain_min_p = any(m > 0 for m in mp)
    floats = u + [max(params[i].temperature, MIN_TEMPERATURE) for i in rows] + (mp if d.plain_min_p else [])
    f = upload(floats, dev, torch.float64)
    k = len(rows)
    d.u = f[:k]
    d.temp = f[k : 2 * k].float()[:, None]
    if d.plain_min_p:
        d.min_p_plain = f[2 * k :].float()[:, None]
    idx = upload_ids(rows + d.plain + d.filt, dev)
    d.rows_t, d.plain_t, d.filt_t = idx[:k], idx[k : k + len(d.plain)], idx[k + len(d.plain) :]
    return d


def kernel_inputs(logits: torch.Tensor, params: list[SamplingParams], hist: list[list[int]]) -> DrawInputs:
    """`draw_inputs` for kernels.sampling.draw: every row's knobs in one upload, with the
    same uniforms."""
    n = logits.shape[0]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    d = DrawInputs(n, rows)
    vals = [0.0] * (4 * n)
    for i, ui in zip(rows, uniforms(params, hist, rows)):
        p = params[i]
        vals[i], vals[n + i], vals[2 * n + i] = ui, max(p.temperature, MIN_TEMPERATURE), p.min_p
        d.kernel_min_p |= p.min_p > 0
    for i, p in enumerate(params):
        if p.grammar is not None:
            vals[3 * n + i] = 1.0
            d.kernel_masked = True
    d.kernel = upload(vals, logits.device, torch.float64).view(4, n)
    return d


def draw_tokens(logits: torch.Tensor, d: DrawInputs) -> torch.Tensor:
    """The chosen token of every row: the argmax for greedy rows, the draw for the others."""
    n, rows = d.n, d.rows
    dev = logits.device
    if len(rows) < n:
        chosen = logits.argmax(-1)
    else:
        chosen = torch.empty(n, dtype=torch.long, device=dev)
    if not rows:
        return chosen
    sub = logits if len(rows) == n else logits[d.rows_t]
    probs = (sub / d.temp).softmax(-1)
    pick = torch.empty(len(rows), dtype=torch.long, device=dev)
    if d.plain:
        whole = len(d.plain) == len(rows)
        pp = probs if whole else probs[d.plain_t]
        if d.plain_min_p:
            pp = pp.masked_fill(pp < d.min_p_plain * pp.amax(-1, keepdim=True), 0.0)
        drawn = inverse_cdf(pp, d.u if whole else d.u[d.plain_t])
        if whole:
            pick = drawn
        else:
            pick[d.plain_t] = drawn
    if d.filt:
        jj = d.filt_t
        pick[jj] = top_filtered_draw(
            probs if len(d.filt) == len(rows) else probs[jj],
            [d.top_k[j] for j in d.filt],
            [d.top_p[j] for j in d.filt],
            [d.min_p[j] for j in d.filt],
            d.u[jj],
        )
    if len(rows) == n:
        return pick
    chosen[d.rows_t] = pick
    return chosen


def package(logits: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams]) -> list[SampledToken]:
    """The chosen tokens with the logprobs asked for (of the processed distribution)."""
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return [SampledToken(t) for t in chosen.tolist()]
    rows = [i for i, w in enumerate(want) if w is not None]
    dev = logits.device
    idx = upload_ids(rows, dev)
    logp = torch.log_softmax(logits[idx], dim=-1)
    kmax = max(want[i] or 0 for i in rows)
    picked = logp.gather(1, chosen[idx][:, None]).squeeze(1).tolist()
    top_v = top_i = None
    if kmax:
        tv, ti = logp.topk(kmax, dim=-1)
        top_v, top_i = tv.tolist(), ti.tolist()
    ids = chosen.tolist()
    out = [SampledToken(t) for t in ids]
    for j, i in enumerate(rows):
        w = want[i] or 0
        tops = (
            list(zip(top_i[j][:w], top_v[j][:w]))
            if w and top_i is not None and top_v is not None
            else None
        )
        out[i] = SampledToken(ids[i], picked[j], tops)
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative (unnormalized) probability exceeds u * total.

    Zero-probability entries are never picked: their cumulative value equals the previous one.
    """
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    j = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last entry with mass
    # (a NaN row would search past the end: never return an id outside the vocabulary)
    return torch.minimum(j, last).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def top_filtered_draw(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float], u: torch.Tensor
) -> torch.Tensor:
    """Draw from softmax probs restricted to top-k, then the top-p nucleus, then min-p of the max.

    Works on the K most probable tokens; rows whose nucleus may extend past them are redone
    with a full sort (filtered_probs).
    """
    n, v = probs.shape
    dev = probs.device
    ks = [k for k in top_k if k < v]
    kk = min(v, max([TOP_CANDIDATES, *ks]))
    vals, idx = probs.topk(kk, dim=-1)
    cand_mass = vals.sum(-1)
    k_t = upload(top_k, dev, torch.long)[:, None]
    p_t = upload(top_p, dev, probs.dtype)[:, None]
    m_t = upload(min_p, dev, probs.dtype)[:, None]
    has_k = k_t < v
    vals = vals.masked_fill(torch.arange(kk, device=dev)[None, :] >= k_t, 0.0)
    vals = torch.where(has_k, vals / vals.sum(-1, keepdim=True), vals)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = vals.cumsum(-1) - vals
    vals = vals.masked_fill(before >= p_t, 0.0)
    vals = vals.masked_fill(vals < m_t * vals[:, :1], 0.0)
    pick = idx.gather(1, inverse_cdf(vals, u)[:, None]).squeeze(1)
    if kk < v:
        # the nucleus of a row without top-k fits when the candidates' mass reaches top_p
        short = [j for j in range(n) if top_k[j] >= v and top_p[j] < 1.0]
        if short:
            js = upload_ids(short, dev)
            redo = js[cand_mass[js] < p_t[js, 0]]
            if redo.numel():
                full = filtered_probs(
                    probs[redo].log(), torch.full((redo.numel(),), v, device=dev), p_t[redo, 0], m_t[redo, 0]
                )
                pick[redo] = inverse_cdf(full, u[redo])
    return pick


def filtered_probs(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Softmax restricted to the top-k, then the top-p nucleus, then min-p of the max."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = probs.cumsum(-1) - probs
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    out = torch.zeros_like(probs)
    out.scatter_(1, order, probs)
    return out / out.sum(-1, keepdim=True)


def one_kernel_row(p: SamplingParams, v: int) -> bool:
    """A row kernels.sampling.draw can sample: no top-k / top-p filter and no logprobs."""
    return p.logprobs is None and (p.greedy or ((p.top_k <= 0 or p.top_k >= v) and p.top_p >= 1.0))
