"""One live server for the whole session: a real uvicorn on a free loopback port.

The model loads once. uvicorn runs on its own event loop in a background
thread; tests talk to it over HTTP / WebSocket like any client, and read the
engine's stats on that loop (`live.stats()`) so they never race the actors.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from streamer.config import EngineConfig, ServerConfig
from streamer.engine.engine import AsyncEngine
from streamer.server.app import ServerState, create_app


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


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="session")
def live() -> Iterator[LiveServer]:
    engine = AsyncEngine(EngineConfig(model="default"))
    config = ServerConfig(served_model_name="smol", max_queue=64, session_idle_timeout=30.0)
    app = create_app(engine, config)
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_ping_interval=None))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    yield LiveServer(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}", loop, app.state.server)
    server.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client
