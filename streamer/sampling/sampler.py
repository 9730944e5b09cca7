"""Turn the last-position logits of a batch into tokens.

Order (one definition, used for sampling and for reported logprobs):
  logits -> logit_bias -> repetition / presence / frequency penalties
         -> grammar bitmask -> banned tokens (EOS before min_tokens)
         = the processed distribution (logprobs are its log_softmax)
         -> temperature -> top-k -> top-p -> min-p -> draw.
Both masks set logits to -inf, so their order does not matter, except that a
ban never empties a row: when the grammar allows only banned tokens (it must
end, min_tokens says not yet) the grammar wins and the ban is dropped.

Greedy rows (temperature 0) take the argmax of the processed logits; a batch
of greedy rows without penalties, masks or logprobs takes a pure argmax fast
path. Every step is vectorized over the batch: per-row knobs become [rows]
tensors, biases / bans / history counts become one scatter each; the sort for
top-k / top-p runs only when some row uses them.

Draws use the exponential race (argmax p / E, E ~ Exp(1), is a draw from p).
A seeded row takes its noise from a generator seeded by (seed, number of output
tokens so far): the noise of a request depends on nothing else, so a seed
reproduces its output whatever shares the batch, across preemptions, and with
no per-request state to forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamer.messages import SampledToken, SamplingParams


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


_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw number `position` (splitmix64-style)."""
    z = (seed * _MIX + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z ^= z >> 31
    z = (z * 0x94D049BB133111EB) & ((1 << 64) - 1)
    z ^= z >> 29
    return z & _MASK63


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._gens: list[torch.Generator] = []

    def forget(self, request_id: str) -> None:
        """Kept for callers; seeded draws hold no per-request state."""

    def _seeded(self, j: int, seed: int) -> torch.Generator:
        while len(self._gens) <= j:
            self._gens.append(torch.Generator(device=self.device))
        return self._gens[j].manual_seed(seed)

    def __call__(self, logits: torch.Tensor, inp: SampleInputs) -> list[SampledToken]:
        params = inp.params
        logits = logits[:, : self.vocab_size]
        plain = (
            inp.bitmask is None
            and all(p.greedy and not _has_penalty(p) and not p.logit_bias and p.logprobs is None for p in params)
            and not any(inp.banned)
        )
        if plain:
            return [SampledToken(t) for t in logits.argmax(-1).tolist()]
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        logits = self._process(logits, inp)
        chosen = self._draw(logits, inp)
        return self._package(logits, chosen, params)

    # ---- processed distribution -------------------------------------------
    def _process(self, logits: torch.Tensor, inp: SampleInputs) -> torch.Tensor:
        params = inp.params
        n, v = logits.shape
        dev = logits.device
        hist = inp.histories
        # logit_bias: one scatter-add for all rows
        br: list[int] = []
        bt: list[int] = []
        bv: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    t = int(t)
                    if 0 <= t < v:
                        br.append(i)
                        bt.append(t)
                        bv.append(float(b))
        if br:
            logits.index_put_(
                (_t(br, dev), _t(bt, dev)), torch.tensor(bv, device=dev, dtype=logits.dtype), accumulate=True
            )
        # penalties: token counts of the rows that have them, one scatter
        prow = [i for i, p in enumerate(params) if _has_penalty(p) and i < len(hist) and hist[i]]
        if prow:
            r: list[int] = []
            toks: list[int] = []
            for j, i in enumerate(prow):
                r.extend([j] * len(hist[i]))
                toks.extend(hist[i])
            counts = torch.zeros(len(prow), v, device=dev)
            tt = _t(toks, dev).clamp_(0, v - 1)
            counts.index_put_((_t(r, dev), tt), torch.ones(len(toks), device=dev), accumulate=True)
            seen = counts > 0
            idx = _t(prow, dev)
            sub = logits[idx]
            rep = torch.tensor([params[i].repetition_penalty for i in prow], device=dev)[:, None]
            freq = torch.tensor([params[i].frequency_penalty for i in prow], device=dev)[:, None]
            pres = torch.tensor([params[i].presence_penalty for i in prow], device=dev)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            sub = sub - freq * counts - pres * seen.float()
            logits[idx] = sub
        # grammar bitmask, on the constrained rows only
        grows: list[int] = []
        if inp.bitmask is not None:
            bm = inp.bitmask
            grows = (bm[:n] != -1).any(-1).nonzero().flatten().tolist()
            if grows:
                apply_bitmask(logits, bm, rows=grows)
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
        return logits

    # ---- draw -------------------------------------------------------------
    def _draw(self, logits: torch.Tensor, inp: SampleInputs) -> torch.Tensor:
        params = inp.params
        n, v = logits.shape
        dev = logits.device
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) < n:
            chosen = logits.argmax(-1)
        else:
            chosen = torch.empty(n, dtype=torch.long, device=dev)
        if not rows:
            return chosen
        full = len(rows) == n
        idx = None if full else _t(rows, dev)
        sub = logits if idx is None else logits[idx]
        temp = torch.tensor([params[i].temperature for i in rows], device=dev)
        sub = sub / temp[:, None]
        top_k = [params[i].top_k if 0 < params[i].top_k < v else v for i in rows]
        top_p = [params[i].top_p for i in rows]
        min_p = [params[i].min_p for i in rows]
        if any(k < v for k in top_k) or any(p < 1.0 for p in top_p):
            probs = filtered_probs(
                sub,
                _t(top_k, dev),
                torch.tensor(top_p, device=dev),
                torch.tensor(min_p, device=dev),
            )
        else:
            probs = sub.softmax(-1)
            if any(m > 0 for m in min_p):
                mp = torch.tensor(min_p, device=dev)[:, None]
                probs = probs.masked_fill(probs < mp * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        hist = inp.histories
        k = 0
        for j, i in enumerate(rows):
            seed = params[i].seed
            if seed is not None:
                pos = len(hist[i]) if i < len(hist) else 0
                noise[j].exponential_(generator=self._seeded(k, draw_seed(seed, pos)))
                k += 1
        pick = (probs / noise.clamp_min_(1e-30)).argmax(-1)
        if idx is None:
            return pick
        chosen[idx] = pick
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
            tops = list(zip(top_i[j][:w], top_v[j][:w])) if w and top_i is not None and top_v is not None else None
            out[i] = SampledToken(ids[i], picked[j], tops)
        return out


def _t(x: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long, device=dev)


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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set to -inf every token whose bit is 0 in the packed int32 bitmask (in place).

    Bit t % 32 of word t // 32 of a row stands for token t; tokens past the mask's width
    are disallowed. rows: only these rows (default all). Uses xgrammar's kernel (CPU
    C++ / Triton on CUDA) when it can, a torch version otherwise.
    """
    global _xgr_apply_ok
    v = logits.shape[1]
    words = bitmask.to(logits.device, non_blocking=True)
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
