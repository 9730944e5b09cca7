"""Prometheus metrics of one app, in a registry of its own.

A registry per app (not prometheus_client's global one) lets tests and
embedders run several apps in one process. Two kinds of metrics:

  - event metrics the server observes as requests flow (counters, latency
    histograms), updated by ServerState and the middleware below;
  - engine gauges read from engine.stats() at scrape time by a collector, so
    they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from streamer.engine_stats import EngineStats
from streamer.messages import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class EngineCollector(Collector):
    """Gauges read from engine.stats() on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        gauges = {
            "streamer_requests_running": ("requests being computed", s.running),
            "streamer_requests_waiting": ("requests waiting for admission", s.waiting),
            "streamer_kv_pages_total": ("KV pages in the pool", s.pages_total),
            "streamer_kv_pages_free": ("KV pages on the free list", s.pages_free),
            "streamer_kv_pages_used": ("KV pages not free (running requests or the prefix cache)", s.pages_used),
            "streamer_kv_pages_cached": ("KV pages held by the radix prefix cache", s.pages_cached),
            "streamer_prefix_cache_hit_rate": ("cached prompt tokens / prompt tokens", s.cache_hit_rate),
            "streamer_mean_batch_size": ("sequences per step, mean", s.mean_batch_size),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "streamer_preemptions": ("requests preempted for lack of KV pages", s.preemptions),
            "streamer_engine_steps": ("model steps run", s.steps),
            "streamer_cached_prompt_tokens": ("prompt tokens served from the prefix cache", s.cached_tokens_total),
            "streamer_steps_held": ("batches scheduled just before the running decode step's end", s.steps_held),
            "streamer_held_steps_joined": ("held batches that took in a request arriving meanwhile",
                                           s.held_steps_joined),
            "streamer_held_steps_late": ("held batches scheduled after the running step ended", s.held_steps_late),
            "streamer_device_busy_seconds": ("seconds the device spent computing steps", s.device_busy_s),
            "streamer_device_idle_seconds": ("seconds the device waited for the host with steps in flight",
                                             s.device_idle_s),
        }
        if s.host is not None:  # the host KV tier (--host-kv-cache-gb)
            h = s.host
            gauges = {"streamer_host_kv_pages_total": ("KV pages in the host tier", h.pages_total),
                      "streamer_host_kv_pages_used": ("host KV pages holding cached prefixes", h.pages_used),
                      "streamer_host_cache_hit_rate": ("prompt tokens loaded back from the host / prompt tokens",
                                                       h.hit_rate)}
            for name, (doc, value) in gauges.items():
                yield GaugeMetricFamily(name, doc, value=value)
            counters = {**counters,
                        "streamer_host_kv_write_backs": ("KV pages written back from the device to the host",
                                                         h.write_backs),
                        "streamer_host_kv_load_backs": ("KV pages loaded back from the host to the device",
                                                        h.load_backs),
                        "streamer_host_kv_bytes_moved": ("bytes copied between the device and the host tier",
                                                         h.bytes_moved),
                        "streamer_host_cached_prompt_tokens": ("prompt tokens served from the host tier",
                                                               h.cached_tokens_total)}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        # speculative decoding (engine/spec; 0 where it is off)
        yield CounterMetricFamily("streamer_spec_decode_draft_tokens", "proposed tokens verified",
                                  value=s.spec_draft_tokens)
        yield CounterMetricFamily("streamer_spec_decode_accepted_tokens", "proposed tokens kept",
                                  value=s.spec_accepted_tokens)
        yield CounterMetricFamily("streamer_spec_decode_verifies", "proposal runs verified (one per request "
                                  "and step)", value=s.spec_verifies)
        per = CounterMetricFamily("streamer_spec_decode_accepted_per_position",
                                  "verifies that kept the proposal at this position (0-based)", labels=["position"])
        for j, n in enumerate(s.spec_accepted_per_position):
            per.add_metric([str(j)], n)
        yield per


class LoopHistogram(Collector):
    """A histogram observed from the event loop only, as prometheus_client's would render it.

    The inter-token latency is observed once per streamed token: prometheus_client's
    Histogram takes a lock and walks its buckets per call (~3 us); at 200 streams that is
    event-loop time the scheduler waits for. Here an observation is a bisect and two adds,
    and `n` observes the same value n times (the tokens of one increment)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n  # bucket le=b counts value <= b
        self.total += value * n

    def collect(self) -> Iterator[Any]:
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.total)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats],
                 replica_stats: Callable[[], list[EngineStats]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("streamer_http_requests", "HTTP requests and WebSocket turns by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("streamer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("streamer_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("streamer_time_to_first_token_seconds", "submit to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("streamer_request_queue_time_seconds",
                                    "arrival at the scheduler to the first batch", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram("streamer_inter_token_latency_seconds", "time between generated tokens",
                                 LATENCY_BUCKETS, r)
        self.e2e = Histogram("streamer_request_latency_seconds", "submit to last output",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter("streamer_requests_finished", "engine requests by finish reason",
                                ["finish_reason"], registry=r)
        r.register(EngineCollector(stats) if replica_stats is None else ReplicaCollector(stats, replica_stats))

    def render(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


class RequestTimer:
    """Per engine request: TTFT, inter-token latency, end-to-end latency, token counts."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.queue_time is not None:
            self.m.queue_time.observe(out.queue_time)
        if out.token_ids:
            if self.first:
                self.m.ttft.observe(now - self.start)
                self.first = False
            else:
                self.m.itl.observe((now - self.last) / len(out.token_ids), len(out.token_ids))
            self.last = now
        if out.finished:
            self.m.e2e.observe(now - self.start)
            self.m.prompt_tokens.inc(out.prompt_tokens)
            self.m.generated_tokens.inc(out.completion_tokens)
            self.m.finished.labels(out.finish_reason or "unknown").inc()
            self.done = True

    def abandoned(self) -> None:
        """The client went away before the final output: the engine request was aborted."""
        if not self.done:
            self.done = True
            self.m.finished.labels("abort").inc()


class RequestCounter:
    """Pure ASGI middleware counting HTTP responses by route and status.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client
    disconnects pass through untouched. Unknown paths share one label so a
    scanner cannot grow the label set without bound.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: set[str]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints
        # a route with parameters (/v1/responses/{response_id}) is labelled by its template: the
        # ids in its paths are unbounded
        self.templates = [(compile_path(e)[0], e) for e in sorted(endpoints) if "{" in e]

    def label(self, path: str) -> str:
        """The endpoint a path counts under: itself, its route's template, or "other"."""
        if path in self.endpoints:
            return path
        return next((e for pattern, e in self.templates if pattern.match(path)), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.label(scope["path"])
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


class ReplicaCollector(Collector):
    """EngineCollector's metrics of data-parallel replicas (router/data_parallel.py): each
    family holds the total, unlabeled as for one engine, and every replica's value with a
    `replica` label (sum(x{replica!=""}) is the total)."""

    def __init__(self, stats: Callable[[], EngineStats], replica_stats: Callable[[], list[EngineStats]]) -> None:
        self.total = EngineCollector(stats)
        self.replica_stats = replica_stats

    def collect(self) -> Iterator[Any]:
        families = list(self.total.collect())
        for i, rs in enumerate(self.replica_stats()):
            for family, part in zip(families, EngineCollector(functools.partial(_same, rs)).collect()):
                family.samples.extend(s._replace(labels={**s.labels, "replica": str(i)}) for s in part.samples)
        yield from families


def _same(stats: EngineStats) -> EngineStats:
    return stats
