"""The router's own metrics: each replica's (or worker's) state and load, and the decisions.

Used by `serve --data-parallel-size` (label replica="0", "1", ...; the replicas' engine
metrics are server/metrics.py's ReplicaCollector) and by `streamer router` (label
worker="http://...").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from streamer.router.policy import RoutingPolicy


class RouterCollector(Collector):
    def __init__(self, policy: RoutingPolicy, label: str, names: list[str], up: Callable[[], list[bool]],
                 sent: Callable[[], list[int]]) -> None:
        self.policy, self.label, self.names, self.up, self.sent = policy, label, names, up, sent

    def collect(self) -> Iterator[Any]:
        what = self.label
        up = GaugeMetricFamily("streamer_router_up", f"1 while the {what} can take requests", labels=[what])
        load = GaugeMetricFamily("streamer_router_open_requests", f"requests (and WebSocket sessions) open on the {what}",
                                 labels=[what])
        sent = CounterMetricFamily("streamer_router_requests", f"requests (and WebSocket sessions) routed to the {what}",
                                   labels=[what])
        for name, ok, n, total in zip(self.names, self.up(), self.policy.load, self.sent()):
            up.add_metric([name], 1.0 if ok else 0.0)
            load.add_metric([name], n)
            sent.add_metric([name], total)
        rules = CounterMetricFamily("streamer_router_decisions", "routing decisions by the rule that made them "
                                    "(session; prefix: a cached prefix; balance: the least loaded)", labels=["rule"])
        for rule, k in self.policy.decisions.as_dict().items():
            rules.add_metric([rule], k)
        yield from (up, load, sent, rules)
