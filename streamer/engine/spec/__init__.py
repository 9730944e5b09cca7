"""Speculative decoding: proposals are just more tokens in the same batch.

A running request whose last token is known gets up to k proposed tokens (ngram.py: prompt
lookup over its own prompt and output; or, with the draft_model and eagle3 methods, k
PLACEHOLDERs that the runner's draft model or EAGLE-3 head draws, model/draft.py and
model/eagle_draft.py). The scheduler sends them as one chunk of 1 + k
tokens that samples at every position (scheduler/batch.py); the runner verifies the whole
chunk in one forward (the extend attention over pages, as for a prefill chunk) and samples
every position as it samples a plain decode; the scheduler keeps the longest run that
agrees with the proposals plus the target's own next token (rollback.py: exact for greedy
and for sampling; a draft model's proposals are decided by sampling/rejection.py) and rolls
back the rest: the rejected tokens' pages go back to the pool,
and the radix tree never sees them, since only computed tokens are cached.

Modules: ngram.py (the proposer), rollback.py (the scheduler's side: who proposes, the
verify chunk, what a verified chunk leaves), report.py (the benchmarks' figures). The
configuration is streamer/speculative_config.py (SpeculativeConfig, parsed and validated).
"""
