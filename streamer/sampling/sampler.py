"""Turn the last-position logits of a batch into tokens.

Order (one definition, used for sampling and for reported logprobs):
  logits -> logit_bias -> repetition / presence / frequency penalties
         -> grammar bitmask -> banned tokens (EOS before min_tokens)
         = the processed distribution (logprobs are its log_softmax)
         -> temperature -> top-k -> top-p -> min-p -> draw.
Both masks set logits to -inf, so their order does not matter, except that a
ban never empties a row: when the grammar allows only banned tokens (it must
end, min_tokens says not yet) the grammar wins and the ban is dropped.

On CUDA, a batch without top-k / top-p rows, bans or logprobs is drawn by one kernel
(kernels.sampling.draw: bitmask, temperature, min-p and the inverse-CDF draw as it
reads the logits, on the rows whose request has a grammar); the torch path below is
its definition and the path of every other batch.

Greedy rows (temperature 0) take the argmax of the processed logits; a batch
of greedy rows without penalties, masks or logprobs takes a pure argmax fast
path. Every step is vectorized over the batch: per-row knobs become [rows]
tensors; biases, bans and penalties are one sparse scatter each over the
(row, token) pairs they touch, never a dense [rows, vocab] pass per knob.

A draw is an inverse-CDF lookup: one uniform u per row, the first token whose
cumulative probability exceeds u (float64 cumsum). Rows with top-k / top-p
work on the K most probable tokens (K = max(TOP_CANDIDATES, largest top_k))
from one topk, not a full-vocabulary sort; a top-p row whose nucleus does not
fit in those K (a very flat distribution) falls back to a full sort.

A seeded row takes its uniform from a hash of (seed, number of output tokens
so far): the draw of a request depends on nothing else, so a seed reproduces
its output whatever shares the batch, across preemptions, on any device, and
with no per-request state to forget. Unseeded rows draw from torch's global
CPU generator (seeded from EngineConfig.seed by the runner).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from streamer.messages import SampledToken, SamplingParams
from streamer.model.staging import PinnedRing

LOGIT_MAX = 1e30
BIAS_CACHE = 1024
"""logit_bias dicts kept as tensors (the running requests' biases, and some)."""
"""Processed logits are capped here (divided by the smallest temperature, still finite)."""
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


@dataclass
class Plan:
    """A step's sampling up to the grammar bitmask (Sampler.plan -> Sampler.finish)."""

    logits: torch.Tensor
    inp: SampleInputs
    done: torch.Tensor | None = None
    """Set when nothing is left to do: the pure argmax fast path."""
    draw: DrawInputs | None = None


@dataclass
class SampleInputs:
    params: list[SamplingParams]
    histories: list[list[int]]
    """Output tokens so far of each row (penalties; the position of seeded draws)."""
    banned: list[list[int]] = field(default_factory=list)
    """Token ids that must not be drawn now, per row (EOS before min_tokens)."""
    request_ids: list[str] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    """int32 [rows, ceil(V/32)] xgrammar bitmask (a row of all ones = unconstrained), or None."""


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


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # grammar bitmasks (1 MB at batch 64 and a 128k vocabulary) go up through pinned
        # buffers: from pageable memory the copy waited for the forward in flight
        self.staging = PinnedRing() if self.device.type == "cuda" else None
        self.one_kernel = self.device.type == "cuda"
        """Draw with kernels.sampling where a batch allows it (CPU: the torch path; tests may
        turn it on there, to run the kernel through the Triton interpreter)."""
        self._biases: OrderedDict[int, tuple[dict, torch.Tensor, torch.Tensor]] = OrderedDict()
        """id(params.logit_bias) -> (that dict, kept so the id stays its own; token ids;
        biases): a request's bias, as tensors, built at its first step rather than at every
        one (a 49k-entry bias at n=64 took the step from ~20 ms to ~1 s in Python loops)."""

    def forget(self, request_id: str) -> None:
        """Kept for callers; seeded draws hold no per-request state."""

    def __call__(self, logits: torch.Tensor, inp: SampleInputs) -> list[SampledToken]:
        out = self.sample(logits, inp)
        return [SampledToken(t) for t in out.tolist()] if isinstance(out, torch.Tensor) else out

    def sample(self, logits: torch.Tensor, inp: SampleInputs) -> torch.Tensor | list[SampledToken]:
        """The chosen token ids, left on the device when no row asks for logprobs (so the
        host need not wait for the step); with logprobs, the packaged tokens."""
        return self.finish(self.plan(logits, inp, masked=inp.bitmask is not None), inp.bitmask)

    def plan(self, logits: torch.Tensor, inp: SampleInputs, masked: bool) -> Plan:
        """Everything of `sample` that does not depend on the grammar bitmask: bias and
        penalties applied, the draw's per-row inputs on the device. masked: a bitmask will be
        given to `finish`. A step whose masks are filled while its forward runs (the
        scheduler's masks_deferred) plans at once and finishes when they arrive, so little
        is left to queue on the device once the masks are in."""
        params = inp.params
        logits = logits[:, : self.vocab_size]
        arithmetic = any(_has_penalty(p) or p.logit_bias for p in params)
        edits = masked or arithmetic or any(inp.banned)
        if not edits and all(p.greedy and p.logprobs is None for p in params):
            return Plan(logits, inp, done=logits.argmax(-1))
        # On CUDA the common case (no top-k / top-p, bans or logprobs) is one kernel that applies
        # the bitmask while it reads the logits (kernels.sampling): nothing is written to them
        one_kernel = self.one_kernel and not any(inp.banned) and all(_one_kernel_row(p, logits.shape[1]) for p in params)
        writes = arithmetic or (edits and not one_kernel)  # (the torch path masks in place)
        if logits.dtype != torch.float32 and (writes or not one_kernel):
            logits = logits.float()
        elif writes:
            logits = logits.clone()
        if arithmetic:
            self._bias_and_penalties(logits, inp)
            # Valid but extreme knobs (a repetition penalty of 1e-300 is 0 in float32) can
            # overflow: keep every logit finite or -inf, so no row turns into NaN. (Masks and
            # bans, applied later, only write -inf: nothing to do for them.)
            logits.nan_to_num_(nan=float("-inf"), posinf=LOGIT_MAX, neginf=float("-inf")).clamp_(max=LOGIT_MAX)
        if one_kernel:
            return Plan(logits, inp, draw=self._kernel_inputs(logits, inp))
        return Plan(logits, inp, draw=self._draw_inputs(logits, inp))

    def finish(self, plan: Plan, bitmask: torch.Tensor | None) -> torch.Tensor | list[SampledToken]:
        """`sample` of a plan, given its bitmask (or None)."""
        if plan.done is not None:
            return plan.done
        logits, inp = plan.logits, plan.inp
        assert plan.draw is not None
        if plan.draw.kernel is not None:
            return self._kernel_draw(logits, plan.draw, bitmask)
        self._mask_and_ban(logits, inp, bitmask)
        chosen = self._draw(logits, plan.draw)
        if all(p.logprobs is None for p in inp.params):
            return chosen
        return self._package(logits, chosen, inp.params)

    # ---- processed distribution -------------------------------------------
    def _bias_and_penalties(self, logits: torch.Tensor, inp: SampleInputs) -> None:
        """Apply logit_bias and the penalties to logits in place."""
        params = inp.params
        n, v = logits.shape
        dev = logits.device
        hist = inp.histories
        # logit_bias: one scatter-add over all (row, token) pairs
        rows = [i for i, p in enumerate(params) if p.logit_bias]
        if rows:
            parts = [self._bias(params[i].logit_bias, v) for i in rows]  # type: ignore[arg-type]
            lengths = torch.tensor([len(t) for t, _ in parts])
            br = torch.repeat_interleave(torch.tensor(rows), lengths)
            bt, bv = torch.cat([t for t, _ in parts]), torch.cat([b for _, b in parts])
            logits.index_put_(
                (br.to(dev, non_blocking=True), bt.to(dev, non_blocking=True)),
                bv.to(dev, logits.dtype, non_blocking=True), accumulate=True,
            )
        # penalties: counts of the distinct (row, token) pairs of the histories, sparse
        pr: list[int] = []
        pt: list[int] = []
        for i, p in enumerate(params):
            if _has_penalty(p) and i < len(hist) and hist[i]:
                pr.extend([i] * len(hist[i]))
                pt.extend(hist[i])
        if pr:
            key = _t(pr, dev) * v + _t(pt, dev).clamp_(0, v - 1)
            key, count = torch.unique(key, return_counts=True)
            rr, tt = key // v, key % v
            rep = _up([p.repetition_penalty for p in params], dev)[rr]
            freq = _up([p.frequency_penalty for p in params], dev)[rr]
            pres = _up([p.presence_penalty for p in params], dev)[rr]
            x = logits[rr, tt]
            x = torch.where(x > 0, x / rep, x * rep) - freq * count - pres
            logits[rr, tt] = x

    def _bias(self, bias: dict[int, float], v: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (token ids, biases) of one request's logit_bias within the vocabulary, cached."""
        hit = self._biases.get(id(bias))
        if hit is not None and hit[0] is bias:
            self._biases.move_to_end(id(bias))
            return hit[1], hit[2]
        pairs = [(int(t), float(b)) for t, b in bias.items() if 0 <= int(t) < v]
        toks = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        vals = torch.tensor([b for _, b in pairs], dtype=torch.float32)
        self._biases[id(bias)] = (bias, toks, vals)
        while len(self._biases) > BIAS_CACHE:
            self._biases.popitem(last=False)
        return toks, vals

    def _mask_and_ban(self, logits: torch.Tensor, inp: SampleInputs, bitmask: torch.Tensor | None) -> None:
        """Apply the grammar bitmask and the bans to logits in place."""
        n, v = logits.shape
        dev = logits.device
        # grammar bitmask, on the constrained rows only
        grows: list[int] = []
        if bitmask is not None:
            bm = bitmask
            if bm.is_cuda:
                grows = (bm[:n] != -1).any(-1).nonzero().flatten().tolist()
            else:  # (numpy: torch's CPU kernels would wake their thread pool for this)
                grows = np.flatnonzero((bm[:n].numpy() != -1).any(1)).tolist()
            if grows:
                every = len(grows) == n == bm.shape[0]  # no row index list to upload
                apply_bitmask(logits, bm, rows=None if every else grows, staging=self.staging)
        # banned tokens; a ban that would empty a grammar row is dropped for that row
        ban_rows = [i for i in range(min(n, len(inp.banned))) if inp.banned[i]]
        if ban_rows:
            keep = None
            both = sorted(set(ban_rows) & set(grows))
            if both:
                bidx = _t(both, dev)
                keep = logits[bidx]
            r, toks = [], []
            for i in ban_rows:
                ids = [t for t in inp.banned[i] if 0 <= t < v]
                r.extend([i] * len(ids))
                toks.extend(ids)
            if r:
                logits.index_put_((_t(r, dev), _t(toks, dev)), torch.tensor(float("-inf"), device=dev))
            if keep is not None:
                now = logits[bidx]
                dead = torch.isneginf(now).all(-1, keepdim=True)
                logits[bidx] = torch.where(dead, keep, now)

    # ---- draw -------------------------------------------------------------
    def _draw_inputs(self, logits: torch.Tensor, inp: SampleInputs) -> DrawInputs:
        """The per-row inputs of the draw, on the device (they do not depend on the logits'
        values: only on the parameters, the histories and the random numbers)."""
        params = inp.params
        n, v = logits.shape
        dev = logits.device
        rows = [i for i, p in enumerate(params) if not p.greedy]
        d = DrawInputs(n, rows)
        if not rows:
            return d
        u = _uniforms(params, inp.histories, rows)
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
        f = _up(floats, dev, torch.float64)
        k = len(rows)
        d.u = f[:k]
        d.temp = f[k : 2 * k].float()[:, None]
        if d.plain_min_p:
            d.min_p_plain = f[2 * k :].float()[:, None]
        idx = _t(rows + d.plain + d.filt, dev)
        d.rows_t, d.plain_t, d.filt_t = idx[:k], idx[k : k + len(d.plain)], idx[k + len(d.plain) :]
        return d

    def _kernel_inputs(self, logits: torch.Tensor, inp: SampleInputs) -> DrawInputs:
        """`_draw_inputs` for kernels.sampling.draw: every row's knobs in one upload, with the
        same uniforms."""
        params = inp.params
        n = logits.shape[0]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        d = DrawInputs(n, rows)
        vals = [0.0] * (4 * n)
        for i, ui in zip(rows, _uniforms(params, inp.histories, rows)):
            p = params[i]
            vals[i], vals[n + i], vals[2 * n + i] = ui, max(p.temperature, MIN_TEMPERATURE), p.min_p
            d.kernel_min_p |= p.min_p > 0
        for i, p in enumerate(params):
            if p.grammar is not None:
                vals[3 * n + i] = 1.0
                d.kernel_masked = True
        d.kernel = _up(vals, logits.device, torch.float64).view(4, n)
        return d

    def _kernel_draw(self, logits: torch.Tensor, d: DrawInputs, bitmask: torch.Tensor | None) -> torch.Tensor:
        from kernels.sampling import draw

        words = None
        if bitmask is not None and d.kernel_masked:
            if bitmask.shape[0] < d.n:  # (a row without its mask row is unconstrained)
                bitmask = torch.cat([bitmask, bitmask.new_full((d.n - bitmask.shape[0], bitmask.shape[1]), -1)])
            words = upload_bitmask(bitmask, logits.device, self.staging)
        return draw(logits, words, d.kernel, d.kernel_min_p)

    def _draw(self, logits: torch.Tensor, d: DrawInputs) -> torch.Tensor:
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

    # ---- logprobs ---------------------------------------------------------
    def _package(self, logits: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams]):
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return [SampledToken(t) for t in chosen.tolist()]
        rows = [i for i, w in enumerate(want) if w is not None]
        dev = logits.device
        idx = _t(rows, dev)
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
    k_t = _up(top_k, dev, torch.long)[:, None]
    p_t = _up(top_p, dev, probs.dtype)[:, None]
    m_t = _up(min_p, dev, probs.dtype)[:, None]
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
            js = _t(short, dev)
            redo = js[cand_mass[js] < p_t[js, 0]]
            if redo.numel():
                full = filtered_probs(
                    probs[redo].log(), torch.full((redo.numel(),), v, device=dev), p_t[redo, 0], m_t[redo, 0]
                )
                pick[redo] = inverse_cdf(full, u[redo])
    return pick


def _t(x: list[int], dev: torch.device) -> torch.Tensor:
    return _up(x, dev, torch.long)


def _up(x: list, dev: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host list on the device without waiting for the stream: a non-blocking copy from
    pageable memory is staged at once, while torch.tensor(x, device=...) would wait for the
    step in flight."""
    return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


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


_BITS = torch.arange(32, dtype=torch.int32)
_xgr_apply_ok = True


def _uniforms(params: list[SamplingParams], hist: list[list[int]], rows: list[int]) -> list[float]:
    """The uniforms of the drawing rows: torch's CPU generator, or a seeded row's own
    (draw_uniform at its number of output tokens)."""
    u = torch.rand(len(rows), dtype=torch.float64).tolist() if rows else []
    for j, i in enumerate(rows):
        seed = params[i].seed
        if seed is not None:
            u[j] = draw_uniform(seed, len(hist[i]) if i < len(hist) else 0)
    return u


def upload_bitmask(bitmask: torch.Tensor, device: torch.device, staging: PinnedRing | None) -> torch.Tensor:
    """The bitmask on `device`; a host mask going to the GPU through pinned staging buffers
    unless it is pinned already (the scheduler fills it so)."""
    if staging is not None and device.type == "cuda" and not bitmask.is_cuda and not bitmask.is_pinned():
        host = staging.take(bitmask.numel(), torch.int32).view(bitmask.shape)
        host.copy_(bitmask)
        return staging.upload(host, device)
    return bitmask.to(device, non_blocking=True)


def _one_kernel_row(p: SamplingParams, v: int) -> bool:
    """A row kernels.sampling.draw can sample: no top-k / top-p filter and no logprobs."""
    return p.logprobs is None and (p.greedy or ((p.top_k <= 0 or p.top_k >= v) and p.top_p >= 1.0))


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None, staging: PinnedRing | None = None
) -> None:
    """Set to -inf every token whose bit is 0 in the packed int32 bitmask (in place).

    Bit t % 32 of word t // 32 of a row stands for token t; tokens past the mask's width
    are disallowed. rows: only these rows (default all). On CUDA, kernels.bitmask's
    kernel; on the CPU xgrammar's C++ kernel when it can, a torch version otherwise.
    staging: pinned buffers for a host bitmask going to the GPU, so that the copy does not
    wait for the stream.
    """
    global _xgr_apply_ok
    v = logits.shape[1]
    words = upload_bitmask(bitmask, logits.device, staging)
    if logits.is_cuda and words.shape[0] >= logits.shape[0]:
        from kernels.bitmask import apply_bitmask_

        apply_bitmask_(logits, words.contiguous(), None if rows is None else _t(rows, logits.device))
        return
    if _xgr_apply_ok and words.shape[1] * 32 >= v and logits.dtype == torch.float32:
        try:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, words, vocab_size=v, indices=rows)
            return
        except Exception:  # noqa: BLE001 - no kernel for this device/build: use torch
            _xgr_apply_ok = False
    sel = logits if rows is None else logits[rows]
    w = words if rows is None else words[rows]
    bits = _BITS.to(logits.device)
    allowed = ((w[:, :, None] >> bits) & 1).bool().flatten(1)[:, :v]
    if allowed.shape[1] < v:
        pad = torch.zeros(allowed.shape[0], v - allowed.shape[1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    sel = sel.masked_fill(~allowed, float("-inf"))
    if rows is None:
        logits.copy_(sel)
    else:
        logits[rows] = sel
