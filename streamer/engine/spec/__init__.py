"""Speculative decoding: proposals are just more tokens in the same batch.

A running request whose last token is known gets up to k proposed tokens (ngram.py: prompt
lookup over its own prompt and output). The scheduler sends them as one chunk of 1 + k
tokens that samples at every position (scheduler/batch.py); the runner verifies the whole
chunk in one forward (the extend attention over pages, as for a prefill chunk) and keeps the
longest accepted run plus one token of the target's own (accept.py: greedy, or rejection
sampling that leaves the output distribution exactly the target's); the scheduler writes
the kept tokens and rolls back the rest (rollback.py: the rejected tokens' pages go back
to the pool, and the radix tree never sees them, since only computed tokens are cached).

Modules: config.py (SpeculativeConfig, parsed and validated), ngram.py (the proposer),
accept.py (acceptance on the device), rollback.py (the scheduler's side: who proposes,
what a verified chunk leaves).
"""
