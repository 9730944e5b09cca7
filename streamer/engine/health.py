"""When an engine that is alive counts as stalled, and what then happens to its requests.

Both engines expose `dead` (it is gone: every open request has ended with an error) and
`stalled` (it is there but makes no progress), each a reason or None; /health answers 503
and new requests are refused while either is set.

  - any engine: a batch has been with the executor for STEP_STALL_S (a stuck device or
    worker thread; the scheduler's clock knows when each batch left, EngineStats.step_age_s);
  - the engine process (remote.py): no frame from it for HEARTBEAT_S, although it sends
    Stats at least every IDLE_STATS_S (it is stopped, or its event loop is stuck). Its open
    requests end with ENGINE_STALLED once the silence reaches FAIL_STALLED_S; if it comes
    back, what it still sends for them is dropped (and the Aborts sent meanwhile free them).

A request with a deadline (SamplingParams.timeout) is ended by the scheduler, which also
works while a step is stuck; its caller's iterator ends it anyway DEADLINE_GRACE_S after
the deadline (outputs.deadline_guard), for an engine that does not answer at all.
"""

from __future__ import annotations

STEP_STALL_S = 60.0
"""Far above any step's time (milliseconds on a GPU; a full-budget prefill of a large model on
a CPU takes seconds), so that only a step that will not end trips it."""
HEARTBEAT_S = 3.0
"""Six missed idle Stats: a busy engine's event loop still turns many times a second."""
FAIL_STALLED_S = 30.0
DEADLINE_GRACE_S = 1.0


def step_stalled(step_age: float) -> str | None:
    if step_age >= STEP_STALL_S:
        return f"a model step has been running for {step_age:.0f} s"
    return None
