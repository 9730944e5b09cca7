"""EngineStats: the scheduler's snapshot for whoever asks (the server's /metrics and
admission, the router, benchmarks), with the host tier's HostStats. Not an actor message:
it is returned by a call (Scheduler.stats), not queued."""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct):
    """Scheduler -> whoever asks (the server's /metrics and admission): a snapshot."""

    running: int
    waiting: int
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_used: int
    cache_hit_rate: float
    cached_tokens_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    preemptions: int
    steps: int
    max_batch_size: int
    mean_batch_size: float
    kv_efficiency: float
    """Time-averaged fraction of the KV slots of running requests' pages that hold live tokens."""
    requests_finished: int
    jump_forward_tokens: int = 0
    """Output tokens a grammar forced and that were appended without a decode step each."""
    steps_ahead: int = 0
    """Batches scheduled while the previous one was still running (overlap)."""
    masks_deferred: int = 0
    """Of those, batches whose grammar masks were filled while their forward ran."""
    steps_held: int = 0
    """Batches scheduled just before the running decode step's predicted end, not at once
    (EngineConfig.hold_ahead_ms)."""
    held_steps_joined: int = 0
    """Of those, batches that took in a request which arrived during the hold."""
    held_steps_late: int = 0
    """Of those, batches scheduled only after the running step had ended (a GPU bubble)."""
    device_busy_s: float = 0.0
    """Seconds the device spent computing steps (CUDA; on the CPU, the steps' wall time)."""
    device_idle_s: float = 0.0
    """Seconds the device sat idle between steps, or inside one waiting for its grammar masks,
    while work was in flight (CUDA): host time the device waited for."""
    step_age_s: float = 0.0
    """Seconds the oldest batch in flight has been with the executor (0: none in flight); a
    step that never returns (a stuck device or worker thread) shows here (engine.stalled)."""
    host: HostStats | None = None
    """The host tier's numbers (None: --host-kv-cache-gb is off)."""
    spec_draft_tokens: int = 0
    """Speculative decoding: tokens proposed and verified..."""
    spec_accepted_tokens: int = 0
    """...and of those, tokens kept (acceptance rate = accepted / draft)."""
    spec_verifies: int = 0
    """Verify chunks (a request's proposals checked in one step); mean accepted length =
    (spec_accepted_tokens + spec_verifies) / spec_verifies tokens per verify."""
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    """Entry j: verifies that kept proposal j (0-based), so entry j / spec_verifies is the
    acceptance of the (j+1)-th proposed token."""


class HostStats(msgspec.Struct):
    """The host KV tier (kv/host.py), in EngineStats."""

    pages_total: int
    pages_used: int
    write_backs: int
    """Pages written back from the device pool."""
    load_backs: int
    """Pages loaded back into the device pool."""
    bytes_moved: int
    """Bytes copied both ways."""
    cached_tokens_total: int
    """Prompt tokens whose KV came back from the host (of cached_tokens_total)."""
    hit_rate: float
    """cached_tokens_total / prompt tokens."""
