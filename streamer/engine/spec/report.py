"""The figures of speculative decoding that the benchmarks print, from the engine's counters
(EngineStats.spec_*, or their /metrics counters) over a run."""

from __future__ import annotations


def spec_summary(draft: float, accepted: float, verifies: float) -> dict[str, float]:
    """acceptance rate: kept / proposed tokens; mean accepted length: tokens a verify step
    produces per request (the kept proposals and the target's own next token). Empty when
    nothing was verified (speculation off, or no proposal ever found)."""
    if verifies <= 0 or draft <= 0:
        return {}
    return {"spec_acceptance_rate": accepted / draft, "spec_mean_accepted_length": (accepted + verifies) / verifies}


def spec_delta(before: object, after: object) -> dict[str, float]:
    """spec_summary between two EngineStats."""
    def d(name: str) -> float:
        return float(getattr(after, name) - getattr(before, name))

    return spec_summary(d("spec_draft_tokens"), d("spec_accepted_tokens"), d("spec_verifies"))
