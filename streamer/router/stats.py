"""The total of the replicas' EngineStats: what one engine of them all would report.

Counts and counters add up; ratios are recomputed from their parts where the parts are
there (the prefix hit rate from cached / prompt tokens), else weighted (the mean batch
size by steps, the KV efficiency by pages in use); the step age is the oldest step's.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from streamer.engine_stats import EngineStats

_WEIGHTED = {"mean_batch_size": "steps", "kv_efficiency": "pages_used"}


def total_stats(parts: Sequence[EngineStats]) -> EngineStats:
    if not parts:
        raise ValueError("no stats to add up")
    values: dict[str, float | int] = {}
    for name in EngineStats.__struct_fields__:
        vals = [getattr(s, name) for s in parts]
        if name == "cache_hit_rate" or not all(type(v) in (int, float) for v in vals):
            continue  # (the rate is recomputed below; nested and list fields keep their defaults)
        if name == "step_age_s":
            values[name] = max(vals)
        elif name in _WEIGHTED:
            weights = [getattr(s, _WEIGHTED[name]) for s in parts]
            w = sum(weights)
            values[name] = sum(v * x for v, x in zip(vals, weights)) / w if w else sum(vals) / len(vals)
        else:
            values[name] = sum(vals)
    prompt = int(values["prompt_tokens_total"])
    values["cache_hit_rate"] = int(values["cached_tokens_total"]) / prompt if prompt else 0.0
    return msgspec.convert(values, EngineStats)
