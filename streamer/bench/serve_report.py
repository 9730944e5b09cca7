"""What `streamer bench serve` reports: the latency summaries of a rate point (`Result`),
the server's own counters read from /metrics around it, and the printed table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from streamer.engine.spec.report import spec_summary

SCRAPED = (
    "streamer_cached_prompt_tokens_total", "streamer_prompt_tokens_total", "streamer_engine_steps_total",
    "streamer_time_to_first_token_seconds_sum", "streamer_time_to_first_token_seconds_count",
    "streamer_request_queue_time_seconds_sum", "streamer_request_queue_time_seconds_count",
    "streamer_steps_held_total", "streamer_held_steps_joined_total", "streamer_held_steps_late_total",
    "streamer_device_busy_seconds_total", "streamer_device_idle_seconds_total",
    "streamer_spec_decode_draft_tokens_total", "streamer_spec_decode_accepted_tokens_total",
    "streamer_spec_decode_verifies_total",
)

# vLLM's counters of the same quantities (its prefix cache counts tokens looked up and found), summed over
# their label sets (one per engine and model), so that the hit rate of a vLLM server is reported too
PEER_COUNTERS = {
    "vllm:prefix_cache_queries_total": "streamer_prompt_tokens_total",
    "vllm:prefix_cache_hits_total": "streamer_cached_prompt_tokens_total",
}


async def scrape(client: Any) -> dict[str, float] | None:
    """The server's counters: cache hit rate, steps, and its own view of TTFT and queueing
    (None when /metrics cannot be read)."""
    try:
        r = await client.get("/metrics")
        r.raise_for_status()
    except Exception:  # noqa: BLE001 - the hit rate is then reported as unknown
        return None
    out: dict[str, float] = {}
    peer: dict[str, float] = {}
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in SCRAPED:  # streamer's unlabeled totals (data-parallel replicas add labeled parts)
            out[name] = float(value)
        elif (ours := PEER_COUNTERS.get(name.split("{", 1)[0])) is not None:
            peer[ours] = peer.get(ours, 0.0) + float(value)
    if "streamer_prompt_tokens_total" not in out:
        out = peer
    return out if "streamer_prompt_tokens_total" in out else None


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Means over one rate point, from the differences of the server's counters: where the
    client's TTFT goes (server TTFT = submit to first token; queue = wait for a first batch)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out: dict[str, float] = {}
    for key, name in (("server_ttft_mean_ms", "streamer_time_to_first_token_seconds"),
                      ("server_queue_mean_ms", "streamer_request_queue_time_seconds")):
        if d.get(name + "_count"):
            out[key] = 1e3 * d[name + "_sum"] / d[name + "_count"]
    for key, name in (("server_steps", "streamer_engine_steps_total"), ("steps_held", "streamer_steps_held_total"),
                      ("held_joined", "streamer_held_steps_joined_total"),
                      ("held_late", "streamer_held_steps_late_total")):
        if name in d:
            out[key] = d[name]
    busy, idle = d.get("streamer_device_busy_seconds_total"), d.get("streamer_device_idle_seconds_total")
    if busy is not None and idle is not None:
        out["device_busy_s"], out["device_idle_s"] = busy, idle
    out.update(spec_summary(*(d.get(f"streamer_spec_decode_{k}_total", 0.0)
                              for k in ("draft_tokens", "accepted_tokens", "verifies"))))
    return out


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": 1e3 * sum(values) / len(values), "p50": 1e3 * pct(values, 50), "p90": 1e3 * pct(values, 90),
            "p99": 1e3 * pct(values, 99)}


@dataclass
class Result:
    request_rate: float | str
    num_prompts: int
    completed: int
    errors: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    input_tokens: int
    output_tokens: int
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    cache_hit_rate: float | None
    cache_hit_rate_usage: float | None
    max_concurrency: int | None
    error_samples: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[Result]) -> None:
    head = (f"{'rate':>6} {'reqs':>5} {'ok':>5} {'err':>4} {'req/s':>6} {'out tok/s':>9} "
            f"{'TTFT p50/p90/p99 ms':>21} {'TPOT p50/p90/p99 ms':>21} {'ITL p50/p90/p99 ms':>21} {'hit%':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        def three(d: dict[str, float | None]) -> str:
            return "/".join(fmt(d[k]) for k in ("p50", "p90", "p99"))

        rate = r.request_rate if isinstance(r.request_rate, str) else f"{r.request_rate:g}"
        hit = None if r.cache_hit_rate is None else 100 * r.cache_hit_rate
        print(f"{rate:>6} {r.num_prompts:5d} {r.completed:5d} {r.errors:4d} {r.request_throughput:6.2f} "
              f"{r.output_throughput:9.1f} {three(r.ttft_ms):>21} {three(r.tpot_ms):>21} {three(r.itl_ms):>21} "
              f"{fmt(hit, '.1f'):>5}")
    for r in results:
        for e in r.error_samples:
            print(f"  error at rate {r.request_rate}: {e}")
        if r.extra:
            print(f"  rate {r.request_rate}: " + ", ".join(f"{k} {fmt(v, '.3g') if isinstance(v, float) else v}"
                                                          for k, v in r.extra.items()))
