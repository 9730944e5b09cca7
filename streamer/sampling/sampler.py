"""Turn the last-position logits of a batch into tokens.

Order (one definition, used for sampling and for reported logprobs):
  logits -> logit_bias -> repetition / presence / frequency penalties
         -> banned tokens (EOS before min_tokens) -> grammar bitmask
         = the processed distribution (logprobs are its log_softmax)
         -> temperature -> top-k -> top-p -> min-p -> draw.
Greedy rows (temperature 0) take the argmax of the processed logits; a batch
of greedy rows without penalties or masks takes a pure argmax fast path.
Seeded rows draw from their own torch.Generator, so a seed reproduces its
output whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamer.messages import SampledToken, SamplingParams


@dataclass
class SampleInputs:
    params: list[SamplingParams]
    histories: list[list[int]]
    """Output tokens so far of each row (penalties)."""
    banned: list[list[int]] = field(default_factory=list)
    """Token ids that must not be drawn now, per row (EOS before min_tokens)."""
    request_ids: list[str] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    """int32 [rows, ceil(V/32)] xgrammar bitmask, or None."""


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request_id] = g
        return g

    def __call__(self, logits: torch.Tensor, inp: SampleInputs) -> list[SampledToken]:
        params = inp.params
        logits = logits[:, : self.vocab_size].float()
        plain = (
            all(p.greedy and not _has_penalty(p) and p.logprobs is None for p in params)
            and inp.bitmask is None
            and not any(inp.banned)
        )
        if plain:
            return [SampledToken(t) for t in logits.argmax(-1).tolist()]
        logits = self._process(logits.clone(), inp)
        chosen = self._draw(logits, inp)
        return self._package(logits, chosen, params)

    def _process(self, logits: torch.Tensor, inp: SampleInputs) -> torch.Tensor:
        for i, p in enumerate(inp.params):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device, dtype=torch.long)
                ids_ok = ids[(ids >= 0) & (ids < logits.shape[1])]
                vals = torch.tensor([p.logit_bias[int(t)] for t in ids_ok.tolist()], device=logits.device)
                logits[i].index_add_(0, ids_ok, vals)
            hist = inp.histories[i] if i < len(inp.histories) else []
            if hist and _has_penalty(p):
                ids = torch.tensor(hist, device=logits.device, dtype=torch.long)
                counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                    0, ids, torch.ones_like(ids, dtype=torch.float)
                )
                seen = counts > 0
                if p.repetition_penalty != 1.0:
                    row = logits[i]
                    pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                    logits[i] = torch.where(seen, pen, row)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * seen.float()
            if i < len(inp.banned) and inp.banned[i]:
                logits[i, inp.banned[i]] = float("-inf")
        if inp.bitmask is not None:
            apply_bitmask(logits, inp.bitmask)
        return logits

    def _draw(self, logits: torch.Tensor, inp: SampleInputs) -> torch.Tensor:
        params = inp.params
        chosen = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return chosen
        idx = torch.tensor(rows, device=logits.device)
        sub = logits[idx]
        temp = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        sub = sub / temp[:, None]
        top_k = torch.tensor(
            [params[i].top_k if params[i].top_k > 0 else sub.shape[1] for i in rows], device=logits.device
        )
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
        min_p = torch.tensor([params[i].min_p for i in rows], device=logits.device)
        probs = filtered_probs(sub, top_k, top_p, min_p)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p,
        # and lets every seeded row use its own generator.
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            p = params[i]
            if p.seed is not None and i < len(inp.request_ids):
                noise[j].exponential_(generator=self._generator(inp.request_ids[i], p.seed))
            else:
                noise[j].exponential_()
        chosen[idx] = (probs / noise).argmax(-1)
        return chosen

    def _package(self, logits: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams]):
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return [SampledToken(t) for t in chosen.tolist()]
        logp = torch.log_softmax(logits, dim=-1)
        kmax = max((w or 0) for w in want)
        top_v, top_i = (logp.topk(kmax, dim=-1) if kmax else (None, None))
        picked = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
        out = []
        for i, t in enumerate(chosen.tolist()):
            if want[i] is None:
                out.append(SampledToken(t))
                continue
            tops = None
            if want[i] and top_v is not None and top_i is not None:
                tops = list(zip(top_i[i, : want[i]].tolist(), top_v[i, : want[i]].tolist()))
            out.append(SampledToken(t, picked[i], tops))
        return out


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or bool(
        p.logit_bias
    )


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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf every token whose bit is 0 in the packed int32 bitmask (in place)."""
    v = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.to(logits.device)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, :v]
    if allowed.shape[1] < v:
        pad = torch.zeros(allowed.shape[0], v - allowed.shape[1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    logits.masked_fill_(~allowed, float("-inf"))
