"""The scheduler's running totals, and the EngineStats snapshot made from them.

Counters are plain integers and floats, bumped where the event happens (admission,
build, step results, preemption); nothing here is read on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamer.engine.scheduler.clock import AheadClock
from streamer.engine_stats import EngineStats, HostStats
from streamer.kv.pages import PagePool
from streamer.kv.radix import RadixCache


@dataclass(slots=True)
class Counters:
    """Totals since the scheduler started."""

    preemptions: int = 0
    prompt_tokens_total: int = 0
    """Prompt tokens of admitted requests (at their first admission)."""
    cached_tokens_total: int = 0
    """Of those, tokens served from the radix cache."""
    generated_tokens_total: int = 0
    finished_total: int = 0
    batch_sizes_sum: int = 0
    max_batch_size: int = 0
    kv_live: int = 0
    """Summed over steps: tokens with KV in running requests' pages..."""
    kv_slots: int = 0
    """...and the slots of those pages (kv_efficiency = kv_live / kv_slots)."""
    jump_forward_tokens: int = 0
    steps_ahead: int = 0
    masks_deferred: int = 0
    device_busy_s: float = 0.0
    device_idle_s: float = 0.0
    isolated_failures: int = 0
    """Failed steps of several requests, each of which then ran its next step alone."""
    cached_host_tokens_total: int = 0
    """Of cached_tokens_total, tokens whose KV came back from the host tier."""
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifies: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    def snapshot(
        self, steps: int, running: int, waiting: int, pool: PagePool, tree: RadixCache, clock: AheadClock, now: float
    ) -> EngineStats:
        return EngineStats(
            running=running,
            waiting=waiting,
            pages_total=pool.capacity,
            pages_free=pool.num_free,
            pages_cached=tree.cached_pages,
            pages_used=pool.capacity - pool.num_free,
            cache_hit_rate=(self.cached_tokens_total / self.prompt_tokens_total) if self.prompt_tokens_total else 0.0,
            cached_tokens_total=self.cached_tokens_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            preemptions=self.preemptions,
            steps=steps,
            max_batch_size=self.max_batch_size,
            mean_batch_size=self.batch_sizes_sum / max(steps, 1),
            kv_efficiency=(self.kv_live / self.kv_slots) if self.kv_slots else 1.0,
            requests_finished=self.finished_total,
            jump_forward_tokens=self.jump_forward_tokens,
            steps_ahead=self.steps_ahead,
            masks_deferred=self.masks_deferred,
            steps_held=clock.held,
            held_steps_joined=clock.joined,
            held_steps_late=clock.late,
            device_busy_s=self.device_busy_s,
            device_idle_s=self.device_idle_s,
            step_age_s=clock.step_age(now),
            host=self._host(tree),
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_verifies=self.spec_verifies,
            spec_accepted_per_position=list(self.spec_accepted_per_position),
        )

    def _host(self, tree: RadixCache) -> HostStats | None:
        tier = tree.tier
        if tier is None:
            return None
        total = tier.host.num_pages
        return HostStats(total, total - tier.host.num_free, tier.write_backs, tier.load_backs,
                         tier.bytes_written + tier.bytes_loaded, self.cached_host_tokens_total,
                         self.cached_host_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0)
