"""Prompt lookup (n-gram) proposals: the request's own prompt and output predict its next
tokens. The longest suffix of the sequence (prompt_lookup_max tokens down to
prompt_lookup_min) that occurred before is looked up; the tokens that followed its latest
earlier occurrence are proposed. Free to compute, and right whenever the output copies the
input (code edits, extraction, quoting, summaries that reuse phrases).

A request's prediction (SamplingParams.prediction, OpenAI's Predicted Outputs: the text the
answer will mostly repeat, as the file an edit starts from) is looked up first
(from_prediction): the longest suffix of the output so far that occurs in the prediction
aligns the two, and what follows it there is proposed."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k proposed next tokens of `tokens` (none: no suffix of lookup_min tokens or more
    occurred before)."""
    n_tok = len(tokens)
    if k <= 0 or n_tok <= lookup_min:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    for n in range(min(lookup_max, n_tok - 1), lookup_min - 1, -1):
        suffix = a[n_tok - n :]
        # starts i <= n_tok - n - 1: every match is followed by at least one token
        cand = np.flatnonzero(a[: n_tok - n] == suffix[0])
        for j in range(1, n):
            if not cand.size:
                break
            cand = cand[a[cand + j] == suffix[j]]
        if cand.size:
            i = int(cand[-1]) + n
            return a[i : i + k].tolist()
    return []


def from_prediction(output: list[int], prediction: np.ndarray | list[int], at: int, k: int, lookup_max: int
                    ) -> tuple[list[int], int]:
    """Up to k proposals from the prediction for an output so far, and the new alignment.

    The longest suffix of `output` (lookup_max tokens down to 1) that occurs in `prediction`
    is looked up; of its occurrences, the first that ends at or after `at` (where the last
    alignment ended: the output moves forward through the prediction) is taken, else the last
    one. Proposed: the tokens after it; nothing when no suffix occurs, or the prediction ends there."""
    p = np.asarray(prediction, dtype=np.int64)  # (the request keeps it as an array: no copy per step)
    if k <= 0 or not output or not p.size:
        return [], at
    for n in range(min(lookup_max, len(output), len(p)), 0, -1):
        suffix = output[-n:]
        cand = np.flatnonzero(p[: len(p) - n + 1] == suffix[0])
        for j in range(1, n):
            if not cand.size:
                break
            cand = cand[p[cand + j] == suffix[j]]
        if cand.size:
            ends = cand + n
            later = ends[ends >= at]
            end = int(later[0]) if later.size else int(ends[-1])
            return p[end : end + k].tolist(), end
    return [], at
