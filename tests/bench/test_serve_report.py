"""What `bench serve` reads from a server's /metrics: streamer's unlabeled totals (a data-parallel
server adds each replica's part with a label, which must not count twice), and the same
counters of a vLLM server, summed over its label sets; a server with neither has no hit rate."""

from __future__ import annotations

import asyncio

from streamer.bench.serve_report import scrape


class FakeClient:
    def __init__(self, text: str) -> None:
        self.text = text

    async def get(self, path: str) -> FakeClient:
        assert path == "/metrics"
        return self

    def raise_for_status(self) -> None:
        pass


def read(text: str) -> dict[str, float] | None:
    return asyncio.run(scrape(FakeClient(text)))


def test_streamer_totals_without_the_replicas_parts():
    got = read("# HELP streamer_prompt_tokens_total prompt tokens\n"
               "streamer_prompt_tokens_total 100.0\n"
               'streamer_prompt_tokens_total{replica="0"} 60.0\n'
               'streamer_prompt_tokens_total{replica="1"} 40.0\n'
               "streamer_cached_prompt_tokens_total 30.0\n")
    assert got == {"streamer_prompt_tokens_total": 100.0, "streamer_cached_prompt_tokens_total": 30.0}


def test_vllm_prefix_cache_counters_summed_over_engines():
    got = read('# TYPE vllm:prefix_cache_queries_total counter\n'
               'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 700.0\n'
               'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0\n'
               'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0\n'
               'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 50.0\n')
    assert got == {"streamer_prompt_tokens_total": 1000.0, "streamer_cached_prompt_tokens_total": 300.0}


def test_a_server_without_either_has_no_counters():
    assert read("process_cpu_seconds_total 1.0\n") is None
