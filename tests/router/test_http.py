"""`streamer router`: two in-process `streamer serve` apps (fake engines, no model) behind
the standalone router, and a third worker URL where nothing listens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from websockets.asyncio.client import connect

from streamer.config import ServerConfig
from streamer.errors import ConfigError
from streamer.messages import GenerateRequest, RequestOutput
from streamer.router.http import create_router_app
from streamer.server.app import create_app
from tests.conftest import free_socket, serve_in_thread
from tests.server.fakes import RecordingEngine


class StreamingEngine(RecordingEngine):
    """Answers every request with "one two three", a word per output."""

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        self.sent.append(request)
        words = ["one", " two", " three"]
        for k, w in enumerate(words):
            last = k == len(words) - 1
            yield RequestOutput(request.request_id, [5 + k], w, finished=last, finish_reason="stop" if last else None,
                                prompt_tokens=3, completion_tokens=k + 1)
            await asyncio.sleep(0)


@dataclass
class Setup:
    url: str
    engines: list[StreamingEngine]
    router: object

    def prompts(self, i: int) -> list[str]:
        return [r.prompt or json.dumps(r.messages) for r in self.engines[i].sent]


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    engines = [StreamingEngine(), StreamingEngine()]
    nobody = free_socket()  # bound, never listening: connections to it are refused
    with serve_in_thread(create_app(engines[0], ServerConfig())) as (p0, _), \
            serve_in_thread(create_app(engines[1], ServerConfig())) as (p1, _):
        urls = [f"http://127.0.0.1:{p}" for p in (p0, nobody.getsockname()[1], p1)]
        app = create_router_app(urls, margin=2)
        with serve_in_thread(app, ws_ping_interval=None) as (port, _):
            yield Setup(f"http://127.0.0.1:{port}", engines, app.state.router)
    nobody.close()


def test_requests_of_one_prefix_go_to_one_worker_and_a_down_worker_is_skipped(setup: Setup) -> None:
    health = httpx.get(f"{setup.url}/health").json()
    assert health["status"] == "degraded"
    assert [w["status"] for w in health["workers"]] == ["ok", "down", "ok"]
    a, b = "A long shared context about apples. " * 10, "Another long context, on boats. " * 10
    with httpx.Client(base_url=setup.url, timeout=30) as http:
        for k in range(4):
            for prefix in (a, b):
                r = http.post("/v1/completions", json={"prompt": prefix + f"Q{k}", "max_tokens": 3})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == "one two three"
    got = [setup.prompts(0), setup.prompts(1)]
    assert sorted(len(g) for g in got) == [4, 4]
    for g in got:  # each worker got all of one group and nothing of the other
        assert len({p[:20] for p in g}) == 1
    assert setup.router.policy.decisions.prefix == 6


def test_a_stream_passes_through_chunk_by_chunk(setup: Setup) -> None:
    body = {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{setup.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "one two three"


def test_a_websocket_session_is_relayed_to_one_worker(setup: Setup) -> None:
    async def main() -> list[dict]:
        async with connect(f"{setup.url.replace('http', 'ws', 1)}/v1/chat/ws") as ws:
            got = [json.loads(await ws.recv())]
            for q in ("Hello?", "Again?"):
                await ws.send(json.dumps({"type": "user", "content": q, "max_tokens": 3}))
                while True:
                    got.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
                    if got[-1]["type"] == "done":
                        break
            return got

    before = [len(e.sent) for e in setup.engines]
    got = asyncio.run(main())
    assert got[0]["type"] == "session"
    assert "".join(m.get("text", "") for m in got if m["type"] == "delta") == "one two three" * 2
    grew = [len(e.sent) - b for e, b in zip(setup.engines, before)]
    assert sorted(grew) == [0, 2]  # both turns on one worker, the second with the whole history
    engine = setup.engines[grew.index(2)]
    assert [m["content"] for m in engine.sent[-1].messages] == ["Hello?", "one two three", "Again?"]


def test_a_worker_that_fails_to_connect_is_marked_down_and_another_answers(setup: Setup) -> None:
    pool = setup.router.pool
    pool.workers[1].up = True  # as if its last check had passed
    r = httpx.post(f"{setup.url}/v1/completions", json={"prompt": "a new prompt", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    assert not pool.workers[1].up and "Connect" in pool.workers[1].error
    text = httpx.get(f"{setup.url}/metrics").text
    assert f'streamer_router_up{{worker="{pool.workers[1].url}"}} 0.0' in text
    assert 'streamer_router_decisions_total{rule="prefix"}' in text
    assert setup.router.policy.load == [0, 0, 0]


def test_a_body_over_the_limit_is_refused_by_the_router(setup: Setup) -> None:
    sent = [len(e.sent) for e in setup.engines]
    big = {"prompt": "x" * (9 << 20), "max_tokens": 1}
    r = httpx.post(f"{setup.url}/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert [len(e.sent) for e in setup.engines] == sent


def test_bad_worker_urls_are_refused() -> None:
    with pytest.raises(ConfigError, match="URL"):
        create_router_app(["localhost:8000"])
    with pytest.raises(ConfigError, match="twice"):
        create_router_app(["http://a:1", "http://a:1/"])


def test_the_cli_takes_the_router_and_the_data_parallel_flags() -> None:
    from streamer.cli import build_parser
    from streamer.server.serve import server_config

    args = build_parser().parse_args(["router", "--worker", "http://a:1", "--worker", "http://b:2",
                                      "--balance-margin", "3", "--port", "9000"])
    assert (args.workers, args.balance_margin, args.port) == (["http://a:1", "http://b:2"], 3, 9000)
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--balance-margin", "5"])
    config = server_config(args, ServerConfig().engine)
    assert (config.data_parallel_size, config.balance_margin) == (2, 5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--data-parallel-size", "0"])
