"""Speculation's figures: /metrics counters, and what the benchmarks print from them."""

from __future__ import annotations

from prometheus_client import generate_latest

from streamer.bench.serve_report import server_view
from streamer.engine.spec.report import spec_delta, spec_summary
from streamer.engine_stats import EngineStats
from streamer.server.metrics import Metrics


def stats(draft: int, accepted: int, verifies: int, per: list[int]) -> EngineStats:
    return EngineStats(0, 0, 10, 10, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, spec_draft_tokens=draft,
                       spec_accepted_tokens=accepted, spec_verifies=verifies, spec_accepted_per_position=per)


def test_metrics_export_the_spec_counters():
    text = generate_latest(Metrics(lambda: stats(40, 25, 10, [9, 8, 5, 3])).registry).decode()
    assert "streamer_spec_decode_draft_tokens_total 40.0" in text
    assert "streamer_spec_decode_accepted_tokens_total 25.0" in text
    assert "streamer_spec_decode_verifies_total 10.0" in text
    assert 'streamer_spec_decode_accepted_per_position_total{position="2"} 5.0' in text
    off = generate_latest(Metrics(lambda: stats(0, 0, 0, [])).registry).decode()
    assert "streamer_spec_decode_draft_tokens_total 0.0" in off


def test_acceptance_rate_and_mean_accepted_length():
    assert spec_summary(40, 25, 10) == {"spec_acceptance_rate": 25 / 40, "spec_mean_accepted_length": 3.5}
    assert spec_summary(0, 0, 0) == {}
    assert spec_delta(stats(10, 5, 4, []), stats(50, 30, 14, [])) == spec_summary(40, 25, 10)
    before = {"streamer_spec_decode_draft_tokens_total": 8.0, "streamer_spec_decode_accepted_tokens_total": 4.0,
              "streamer_spec_decode_verifies_total": 2.0}
    after = {"streamer_spec_decode_draft_tokens_total": 48.0, "streamer_spec_decode_accepted_tokens_total": 29.0,
             "streamer_spec_decode_verifies_total": 12.0}
    view = server_view(before, after)
    assert view["spec_acceptance_rate"] == 25 / 40 and view["spec_mean_accepted_length"] == 3.5

