"""Prompt lookup (n-gram) proposals: the request's own prompt and output predict its next
tokens. The longest suffix of the sequence (prompt_lookup_max tokens down to
prompt_lookup_min) that occurred before is looked up; the tokens that followed its latest
earlier occurrence are proposed. Free to compute, and right whenever the output copies the
input (code edits, extraction, quoting, summaries that reuse phrases)."""

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
