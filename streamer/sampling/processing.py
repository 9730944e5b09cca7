"""The processed distribution: logits -> logit_bias -> repetition / presence / frequency
penalties -> grammar bitmask -> banned tokens (see sampler.py for the whole order).

Each edit is one sparse scatter over the (row, token) pairs it touches, in place on the
float32 logits the sampler hands in. The bias and penalties are applied when a step is
planned (they do not depend on the grammar); the bitmask and bans once its masks are in.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamer.messages import SamplingParams

if TYPE_CHECKING:
    from streamer.staging import PinnedRing

LOGIT_MAX = 1e30
"""Processed logits are capped here (divided by the smallest temperature, still finite)."""
BIAS_CACHE = 1024
"""logit_bias dicts kept as tensors (the running requests' biases, and some)."""

BiasCache = OrderedDict[int, tuple[dict | list, torch.Tensor, torch.Tensor]]
"""id(params.logit_bias) -> (that dict, kept so the id stays its own; token ids; biases), and
id(params.allowed_token_ids) -> (that list; token ids; the same)."""


def bias_and_penalties(
    logits: torch.Tensor, params: list[SamplingParams], hist: list[list[int]], biases: BiasCache
) -> None:
    """Apply logit_bias, the penalties and allowed_token_ids to logits in place (biases: the
    tensors of the requests' logit_bias dicts, `bias_tensors`)."""
    n, v = logits.shape
    dev = logits.device
    # logit_bias: one scatter-add over all (row, token) pairs
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if rows:
        parts = [bias_tensors(biases, params[i].logit_bias, v) for i in rows]  # type: ignore[arg-type]
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
        if has_penalty(p) and i < len(hist) and hist[i]:
            pr.extend([i] * len(hist[i]))
            pt.extend(hist[i])
    if pr:
        key = upload_ids(pr, dev) * v + upload_ids(pt, dev).clamp_(0, v - 1)
        key, count = torch.unique(key, return_counts=True)
        rr, tt = key // v, key % v
        rep = upload([p.repetition_penalty for p in params], dev)[rr]
        freq = upload([p.frequency_penalty for p in params], dev)[rr]
        pres = upload([p.presence_penalty for p in params], dev)[rr]
        x = logits[rr, tt]
        x = torch.where(x > 0, x / rep, x * rep) - freq * count - pres
        logits[rr, tt] = x
    # allowed_token_ids: every other logit of the row -inf (one masked_fill over those rows)
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if rows:
        keep = torch.zeros(len(rows), v, dtype=torch.bool, device=dev)  # (made on the device: no [rows, V] copy)
        for k, i in enumerate(rows):
            keep[k, allowed_tensor(biases, params[i].allowed_token_ids or [], v).to(dev, non_blocking=True)] = True
        at = torch.tensor(rows).to(dev, non_blocking=True)
        logits[at] = logits[at].masked_fill_(~keep, float("-inf"))


def bias_tensors(biases: BiasCache, bias: dict[int, float], v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token ids, biases) of one request's logit_bias within the vocabulary, cached in
    `biases`."""
    hit = biases.get(id(bias))
    if hit is not None and hit[0] is bias:
        biases.move_to_end(id(bias))
        return hit[1], hit[2]
    pairs = [(int(t), float(b)) for t, b in bias.items() if 0 <= int(t) < v]
    toks = torch.tensor([t for t, _ in pairs], dtype=torch.long)
    vals = torch.tensor([b for _, b in pairs], dtype=torch.float32)
    biases[id(bias)] = (bias, toks, vals)
    while len(biases) > BIAS_CACHE:
        biases.popitem(last=False)
    return toks, vals


def allowed_tensor(biases: BiasCache, allowed: list[int], v: int) -> torch.Tensor:
    """One request's allowed_token_ids within the vocabulary as a tensor, cached in `biases`
    beside the logit_bias tensors (a list's id, as a dict's there)."""
    hit = biases.get(id(allowed))
    if hit is not None and hit[0] is allowed:
        biases.move_to_end(id(allowed))
        return hit[1]
    toks = torch.tensor([t for t in allowed if 0 <= t < v], dtype=torch.long)
    biases[id(allowed)] = (allowed, toks, toks)
    while len(biases) > BIAS_CACHE:
        biases.popitem(last=False)
    return toks


def mask_and_ban(
    logits: torch.Tensor, banned: list[list[int]], bitmask: torch.Tensor | None, staging: PinnedRing | None
) -> None:
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
            apply_bitmask(logits, bm, rows=None if every else grows, staging=staging)
    # banned tokens; a ban that would empty a grammar row is dropped for that row
    ban_rows = [i for i in range(min(n, len(banned))) if banned[i]]
    if ban_rows:
        keep = None
        both = sorted(set(ban_rows) & set(grows))
        if both:
            bidx = upload_ids(both, dev)
            keep = logits[bidx]
        r, toks = [], []
        for i in ban_rows:
            ids = [t for t in banned[i] if 0 <= t < v]
            r.extend([i] * len(ids))
            toks.extend(ids)
        if r:
            logits.index_put_((upload_ids(r, dev), upload_ids(toks, dev)), torch.tensor(float("-inf"), device=dev))
        if keep is not None:
            now = logits[bidx]
            dead = torch.isneginf(now).all(-1, keepdim=True)
            logits[bidx] = torch.where(dead, keep, now)


def upload_ids(x: list[int], dev: torch.device) -> torch.Tensor:
    return upload(x, dev, torch.long)


def upload(x: list, dev: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host list on the device without waiting for the stream: a non-blocking copy from
    pageable memory is staged at once, while torch.tensor(x, device=...) would wait for the
    step in flight."""
    return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def edits_logits(p: SamplingParams) -> bool:
    """Whether bias_and_penalties changes p's row: a penalty, logit_bias or allowed_token_ids."""
    return has_penalty(p) or bool(p.logit_bias) or p.allowed_token_ids is not None


_BITS = torch.arange(32, dtype=torch.int32)
_xgr_apply_ok = True


def upload_bitmask(bitmask: torch.Tensor, device: torch.device, staging: PinnedRing | None) -> torch.Tensor:
    """The bitmask on `device`; a host mask going to the GPU through pinned staging buffers
    unless it is pinned already (the scheduler fills it so)."""
    if staging is not None and device.type == "cuda" and not bitmask.is_cuda and not bitmask.is_pinned():
        host = staging.take(bitmask.numel(), torch.int32).view(bitmask.shape)
        host.copy_(bitmask)
        return staging.upload(host, device)
    return bitmask.to(device, non_blocking=True)


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

        apply_bitmask_(logits, words.contiguous(), None if rows is None else upload_ids(rows, logits.device))
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
