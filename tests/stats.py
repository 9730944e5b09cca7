"""Statistics the sampling tests share."""

from __future__ import annotations

import torch


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed counts against probabilities; no count may fall where
    the probability is 0."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support came out"
    exp = probs[keep] * counts.sum()
    return float(((counts[keep] - exp) ** 2 / exp).sum())
