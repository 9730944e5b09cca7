"""`streamer bench serve` against a live server: every request completes, the latency
summaries and token counts are filled in, and the hit rate read from /metrics shows
the shared prefixes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.reliability.conftest import ServerProcess


def test_bench_serve_reports_a_shared_prefix_sweep(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "streamer", "bench", "serve", "--base-url", server.url,
           "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "4", "--prefix-len", "96",
           "--question-len", "8", "--output-len", "4", "--request-rate", "20,inf", "--seed", "1",
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:] + server.log_tail()
    assert "TTFT" in run.stdout  # the printed table
    results = json.loads(out.read_text())["results"]
    assert [r["request_rate"] for r in results] == [20.0, "inf"]
    for r in results:
        assert r["completed"] == 8 and r["errors"] == 0, r["error_samples"]
        assert r["output_tokens"] == 8 * 4  # EOS ignored: every request runs to max_tokens
        assert r["ttft_ms"]["p50"] is not None and r["ttft_ms"]["p50"] > 0
        assert r["output_throughput"] > 0
    # 2 groups x 4 prompts share 96-token prefixes: most of the second point's prompts hit
    assert results[-1]["cache_hit_rate"] > 0.3, results[-1]["cache_hit_rate"]
    server.wait_idle()
