"""A headless locust run against the CPU server, and the server's memory around it.

The same traffic runs twice for 10 s: once to warm up (allocator pools,
tokenizer and grammar caches, the prefix cache filling), then measured. Both
runs are as long, so that the measured one meets no batch shape (and no
allocation peak) the warm-up has not: on a loaded CI machine a 5 s warm-up
saw smaller batches than the run after it and the server's RSS grew 12%. It must end with no failure, and the server's resident memory after
it must be within 10% of its value after the warm-up (no growth under steady
load), and under 2 GB for the default model (PSS of the server and its children: conftest.py).
"""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

from tests.reliability.conftest import REPO, VENV_BIN, ServerProcess

LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
RSS_LIMIT = 2 << 30
LOAD_ENV = {
    "LOADTEST_MAX_TOKENS": "12",
    "LOADTEST_LONG_WORDS": "300",
    "LOADTEST_SHARED_WORDS": "300",
    "LOADTEST_WS_TURNS": "2",
    "LOADTEST_WAIT": "0.2,1",
    "LOADTEST_TIMEOUT": "60",
}


def run_locust(server: ServerProcess, out: Path, seconds: int, users: int = 8) -> list[dict[str, str]]:
    """locust --headless against the server; the rows of its stats CSV."""
    prefix = out / "locust"
    cmd = [str(VENV_BIN / "locust"), "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", "4",
           "-t", f"{seconds}s", "--host", server.url, "--csv", str(prefix), "--only-summary",
           "--stop-timeout", "20", "--loglevel", "WARNING"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **LOAD_ENV}, capture_output=True, text=True,
                          timeout=seconds + 90)
    stats = prefix.with_name("locust_stats.csv")
    assert stats.exists(), f"locust wrote no stats (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(stats, newline="") as f:
        rows = list(csv.DictReader(f))
    failures = prefix.with_name("locust_failures.csv")
    failed = failures.read_text() if failures.exists() else ""
    agg = next(r for r in rows if r["Name"] == "Aggregated")
    assert int(agg["Failure Count"]) == 0, (
        f"locust failures:\n{failed}\n{proc.stderr[-3000:]}\nserver log:\n{server.log_tail()}")
    assert proc.returncode == 0, f"locust exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert server.alive(), server.log_tail()
    return rows


def test_locust_run_without_failures_and_stable_memory(server: ServerProcess, tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    run_locust(server, warm, seconds=10)
    server.wait_idle(timeout=30)
    rss_warm = server.rss()

    rows = run_locust(server, tmp_path, seconds=10)
    by_name = {(r["Type"], r["Name"]): r for r in rows}
    # every kind of traffic ran, and the SSE timings were recorded as their own entries
    for key in [("POST", "POST chat [stream]"), ("POST", "POST completions"), ("WS", "turn"),
                ("SSE", "ttft"), ("SSE", "itl"), ("SSE", "tpot"), ("SSE", "tokens_per_s")]:
        assert key in by_name and int(by_name[key]["Request Count"]) > 0, f"no {key} in {sorted(by_name)}"
    m = server.wait_idle(timeout=30)
    assert m["streamer_prefix_cache_hit_rate"] > 0, "the shared system prompt should hit the prefix cache"

    rss_after = server.rss()
    print(f"\nserver RSS after warm-up {rss_warm / 2**20:.0f} MiB, after the measured run {rss_after / 2**20:.0f} MiB")
    assert abs(rss_after - rss_warm) <= 0.10 * rss_warm, (
        f"resident memory moved by more than 10%: {rss_warm / 2**20:.0f} MiB after warm-up, "
        f"{rss_after / 2**20:.0f} MiB after the run")
    assert rss_after < RSS_LIMIT, f"the default-model server uses {rss_after / 2**20:.0f} MiB resident (limit 2 GiB)"
