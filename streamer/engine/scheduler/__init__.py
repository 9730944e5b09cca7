"""The scheduler: which requests compute which tokens, one step at a time.

NOTE: there are no prefill and decode phases. Every running request just
catches its KV up: `num_computed` chases `len(tokens)`. A prefill is a chunk
of many tokens, a decode is a chunk of one; both share the per-step token
budget, and a chunk that reaches the last token samples the next one.

  policy.py     Scheduler: the request sets and what runs next (admission, the cache-aware
                order, decodes first); synchronous, tested without an event loop
  pages.py      Pages: who holds which KV page (pool + radix tree): grow, release, preempt,
                retry, and the requests whose pages wait for a batch in flight
  batch.py      BatchBuilder: the chosen chunks -> one Batch (PLACEHOLDERs, grammar masks)
  results.py    a StepOutput in, TokenDeltas out: tokens, stop reasons, grammar errors,
                jump-forward
  deadlines.py  Deadlines: SamplingParams.timeout
  stats.py      Counters: the running totals, and the EngineStats snapshot
  clock.py      AheadClock: when to schedule the batch after the running one (hold-ahead)
  actor.py      run: the actor loop (its inbox and outbox are described there)
"""

from streamer.engine.request import PLACEHOLDER
from streamer.engine.scheduler.actor import run
from streamer.engine.scheduler.clock import AheadClock
from streamer.engine.scheduler.policy import Scheduler

__all__ = ["PLACEHOLDER", "AheadClock", "Scheduler", "run"]
