"""--data-parallel-size 2: two engine processes behind the cache-aware router, one server.

One DataParallelEngine of the default model for the module (each engine process costs
seconds to start), served by a real uvicorn; the single-replica reference is the session's
in-process server (`live`). The test that kills a replica comes last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from streamer.config import EngineConfig, ServerConfig
from streamer.engine_stats import EngineStats
from streamer.errors import ConfigError, ModelLoadError
from streamer.messages import ENGINE_DOWN, GenerateRequest, RequestOutput, SamplingParams
from streamer.router.data_parallel import DataParallelEngine
from streamer.server.app import create_app
from tests.conftest import serve_in_thread
from tests.server.test_websocket import recv, turn

ONE = SamplingParams(max_tokens=1, temperature=0)
GROUPS, PER_GROUP = 4, 8


@dataclass
class Served:
    engine: DataParallelEngine
    loop: asyncio.AbstractEventLoop
    url: str

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def dp(default_model) -> Iterator[Served]:
    engine = DataParallelEngine(EngineConfig(model="default", allow_runtime_lora_updating=True), 2)
    app = create_app(engine, ServerConfig(served_model_name="smol", data_parallel_size=2))
    with serve_in_thread(app, ws_ping_interval=None) as (port, loop):
        yield Served(engine, loop, f"http://127.0.0.1:{port}")


def prefix(tag: str, g: int) -> str:
    """A long prefix of its own per group (~250 tokens)."""
    words = " ".join(f"{tag}{g}w{k}" for k in range(60))
    return f"Context {tag} {g}: {words}.\n"


async def workload(engine: Any, tag: str) -> None:
    """4 groups x 8 requests, each group with its own shared prefix: one request of each
    group first (they fill the caches), then the other 28 at once, the groups interleaved
    two by two (so that a router blind to prefixes, round-robin, splits every group)."""
    def req(g: int, k: int) -> GenerateRequest:
        return GenerateRequest(request_id=f"{tag}-{g}-{k}", prompt=prefix(tag, g) + f"Question {k}?", params=ONE)

    await asyncio.gather(*(engine.generate(req(g, 0)) for g in range(GROUPS)))
    pairs = [(g, k) for j in range(1, PER_GROUP, 2) for g in range(GROUPS) for k in (j, j + 1) if k < PER_GROUP]
    await asyncio.gather(*(engine.generate(req(g, k)) for g, k in pairs))


def settled(read: Any, finished: int, timeout: float = 20) -> EngineStats:
    """Stats once `finished` requests have finished by them (a replica's stats lag its outputs)."""
    deadline = time.monotonic() + timeout
    while True:
        s = read()
        if s.requests_finished >= finished and s.running == 0:
            return s
        assert time.monotonic() < deadline, f"stats did not settle: {s}"
        time.sleep(0.05)


def hit_rate(before: EngineStats, after: EngineStats) -> float:
    return (after.cached_tokens_total - before.cached_tokens_total) / (
        after.prompt_tokens_total - before.prompt_tokens_total)


def test_a_shared_prefix_workload_keeps_the_single_replica_hit_rate(dp: Served, live) -> None:
    n = GROUPS * PER_GROUP
    one = live.wait_idle()
    asyncio.run_coroutine_threadsafe(workload(live.state.engine, "s"), live.loop).result(120)
    single = hit_rate(one, settled(live.stats, one.requests_finished + n))

    engine = dp.engine
    before = engine.replica_stats()
    total_before = engine.stats()
    dp.run(workload(engine, "d"))
    total = settled(engine.stats, total_before.requests_finished + n)
    after = engine.replica_stats()
    rate = hit_rate(total_before, total)
    assert single > 0.5  # the workload is mostly shared prefixes
    assert rate >= 0.9 * single, (rate, single)
    # the load was spread (each replica took groups of its own) and stayed within the margin
    served = [a.prompt_tokens_total - b.prompt_tokens_total for a, b in zip(after, before)]
    assert min(served) > 0, served
    assert engine.policy.max_spread <= engine.policy.margin
    assert sum(s.cached_tokens_total for s in after) == total.cached_tokens_total


def test_an_abort_reaches_the_replica_that_holds_the_request(dp: Served, monkeypatch) -> None:
    engine = dp.engine
    sent: list[tuple[int, str]] = []
    for i, replica in enumerate(engine.replicas):
        monkeypatch.setattr(replica, "abort", lambda rid, i=i, f=replica.abort: (sent.append((i, rid)), f(rid)))

    async def main() -> tuple[int | None, list[RequestOutput]]:
        req = GenerateRequest(request_id="long-1", prompt="Write a long story about the sea.",
                              params=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        outputs = engine.submit(req)
        outs = [await anext(outputs)]
        holder = engine.replica_of("long-1")
        engine.abort("long-1")
        engine.abort("nobody-holds-this")  # a no-op, as for one engine
        outs += [o async for o in outputs]
        return holder, outs

    holder, outs = dp.run(main())
    assert holder is not None
    assert sent == [(holder, "long-1")]
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in outs) < 400
    assert engine.replica_of("long-1") is None


def test_a_websocket_session_sticks_to_its_replica(dp: Served) -> None:
    engine = dp.engine

    async def main() -> tuple[str, list[dict]]:
        async with connect(f"{dp.url.replace('http', 'ws', 1)}/v1/chat/ws") as ws:
            hello = await recv(ws)
            dones = []
            for q in ("Hi! What is your name?", "What is 2 + 2?", "Name a color."):
                _, done = await turn(ws, q, max_tokens=4, temperature=0)
                dones.append(done)
                # between turns, load the session's replica past the margin: the session stays
                i = engine.policy.session_replica(hello["id"])
                assert i is not None
                engine.policy.load[i] += engine.policy.margin + 1
                pinned.append(i)
            return hello["id"], dones

    pinned: list[int] = []
    sessions = engine.policy.decisions.session
    try:
        _, dones = dp.run(main())
    finally:
        for i in pinned:
            engine.policy.load[i] -= engine.policy.margin + 1
    assert len(set(pinned)) == 1
    assert engine.policy.decisions.session == sessions + 2  # turns 2 and 3 went by the session
    assert all(d["finish_reason"] in ("stop", "length") for d in dones)
    assert dones[2]["usage"]["cached_tokens"] > 0  # the replica's cache held the conversation


def test_metrics_per_replica_and_in_total(dp: Served) -> None:
    text = httpx.get(f"{dp.url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("streamer_cached_prompt_tokens_total"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    total = values.pop("streamer_cached_prompt_tokens_total")
    assert set(values) == {'streamer_cached_prompt_tokens_total{replica="0"}',
                           'streamer_cached_prompt_tokens_total{replica="1"}'}
    assert sum(values.values()) == total > 0
    assert 'streamer_requests_running{replica="1"}' in text
    assert 'streamer_router_up{replica="0"} 1.0' in text
    assert 'streamer_router_decisions_total{rule="prefix"}' in text


def test_too_few_devices_no_engine_process_and_the_offline_llm_are_refused() -> None:
    from streamer import LLM

    with pytest.raises(ConfigError, match="streamer serve --data-parallel-size"):
        LLM(data_parallel_size=2)
    with pytest.raises(ConfigError, match="--no-engine-process"):
        ServerConfig(data_parallel_size=2, engine_process=False)
    with pytest.raises(ConfigError, match="names one device"):
        DataParallelEngine(EngineConfig(device="cuda:1"), 2)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "3"
    try:
        with pytest.raises(ConfigError, match="needs 2 CUDA devices, and 1 are visible"):
            DataParallelEngine(EngineConfig(device="cuda"), 2)
    finally:
        if env is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env


def test_a_replica_that_fails_to_start_fails_the_launch_with_its_error(tmp_path) -> None:
    engine = DataParallelEngine(EngineConfig(model=str(tmp_path / "nowhere")), 2)
    with pytest.raises(ModelLoadError, match="no such model folder"):
        engine.launch()
    for replica in engine.replicas:  # every process has exited and was reaped
        assert replica.pid is not None and not os.path.exists(f"/proc/{replica.pid}")


def test_a_lora_adapter_loads_and_unloads_on_every_replica(dp: Served, default_model, tmp_path) -> None:
    from tests.model.lora_files import make_adapter

    folder = make_adapter(tmp_path / "terse", default_model, ["q_proj"], rank=2, alpha=4, seed=1)
    r = httpx.post(dp.url + "/v1/load_lora_adapter", json={"lora_name": "terse", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    assert [rep.info.loras for rep in dp.engine.replicas] == [(), ()]
    r = httpx.post(dp.url + "/v1/load_lora_adapter", json={"lora_name": "terse", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    assert [rep.info.loras for rep in dp.engine.replicas] == [("terse",), ("terse",)]
    for k in range(4):  # (distinct prompts: the router spreads them)
        r = httpx.post(dp.url + "/v1/completions", json={"model": "terse", "prompt": f"Item {k}:", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "terse", r.text
    r = httpx.post(dp.url + "/v1/unload_lora_adapter", json={"lora_name": "terse"})
    assert r.status_code == 200, r.text
    assert [rep.info.loras for rep in dp.engine.replicas] == [(), ()]


def test_a_dead_replica_fails_its_own_requests_and_health_reports_it(dp: Served) -> None:
    """Last: it kills replica 1."""
    engine = dp.engine
    victim = engine.replicas[1]

    async def main() -> dict[int | None, list[RequestOutput]]:
        long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        # two new prompts (no common head) at equal load: one on each replica
        a = engine.submit(GenerateRequest(request_id="dead-a", prompt="Rivers: tell me how they form.", params=long))
        outs_a = [await anext(a)]
        b = engine.submit(GenerateRequest(request_id="dead-b", prompt="Which mountains are the highest?", params=long))
        outs_b = [await anext(b)]
        on = [engine.replica_of("dead-a"), engine.replica_of("dead-b")]
        os.kill(victim.pid, signal.SIGKILL)
        outs_a += [o async for o in a]
        outs_b += [o async for o in b]
        return dict(zip(on, [outs_a, outs_b]))

    by_replica = dp.run(main())
    assert set(by_replica) == {0, 1}
    assert by_replica[1][-1].finish_reason == "error" and by_replica[1][-1].error_code == ENGINE_DOWN
    assert by_replica[0][-1].finish_reason == "length"
    assert victim.dead and engine.dead is None
    health = httpx.get(f"{dp.url}/health", timeout=30)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded"
    assert [r["status"] for r in body["replicas"]] == ["ok", "down"]
    # new requests go to the replica that is left
    done = httpx.post(f"{dp.url}/v1/completions", json={"prompt": "Tell me about mountains.", "max_tokens": 2},
                      timeout=60)
    assert done.status_code == 200, done.text
    assert engine.policy.load == [0, 0]
