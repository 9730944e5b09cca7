"""One live server for the whole session: a real uvicorn on a free loopback port.

The model loads once. uvicorn runs on its own event loop in a background
thread; tests talk to it over HTTP / WebSocket like any client, and read the
engine's stats on that loop (`live.stats()`) so they never race the actors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from streamer.config import EngineConfig, ServerConfig
from streamer.engine.engine import AsyncEngine
from streamer.server.app import create_app
from streamer.server.state import ServerState
from tests.conftest import serve_in_thread


@dataclass
class LiveServer:
    url: str
    ws_url: str
    loop: asyncio.AbstractEventLoop
    state: ServerState

    def stats(self) -> Any:
        async def read() -> Any:
            return self.state.engine.stats()

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def wait_idle(self, timeout: float = 20.0) -> Any:
        """Stats once nothing runs or waits, every page free or cached (the page invariant after requests)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.running == 0 and s.waiting == 0 and s.pages_used == s.pages_cached and not self.state.inflight:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {s}, in flight {self.state.inflight}")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def live() -> Iterator[LiveServer]:
    engine = AsyncEngine(EngineConfig(model="default"))
    config = ServerConfig(served_model_name="smol", max_queue=64, session_idle_timeout=30.0)
    app = create_app(engine, config)
    with serve_in_thread(app, ws_ping_interval=None) as (port, loop):
        yield LiveServer(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}", loop, app.state.server)


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def parsing(default_model) -> Iterator[Any]:
    """A server with the qwen3 reasoning parser and hermes calls over a fake engine whose
    answer is set per test (`engine.text`), detokenized token by token by the default
    model's tokenizer: (engine, client)."""
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from tests.server.fakes import Detokenizing

    engine = Detokenizing(AutoTokenizer.from_pretrained(str(default_model)), "")
    config = ServerConfig(allowed_hosts=("testserver",), reasoning_parser="qwen3", tool_call_parser="hermes")
    with TestClient(create_app(engine, config)) as client:
        yield engine, client
