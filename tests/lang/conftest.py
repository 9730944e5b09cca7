"""One in-process engine for the tests of the frontend language, and one live server
(uvicorn with the native routes, on a free loopback port) for RuntimeEndpoint."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamer import LLM
from streamer.lang import EngineBackend


@pytest.fixture(scope="session")
def llm() -> Iterator[LLM]:
    with LLM("default") as llm:
        yield llm


@pytest.fixture(scope="session")
def backend(llm) -> EngineBackend:
    return EngineBackend(llm)


@pytest.fixture(scope="session")
def live_url() -> Iterator[str]:
    """The server's app (server/app.py) with the native routes added, as the server mounts them."""
    import uvicorn

    from streamer.config import ServerConfig
    from streamer.engine.engine import AsyncEngine
    from streamer.server.app import create_app

    engine = AsyncEngine(model="default")
    app = create_app(engine, ServerConfig())  # mounts the native routes
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    sock.close()


def line_of(name: str, file: str) -> int:
    """The number of the one line of `file` marked with the comment `#: name`."""
    marker = f"#: {name}"
    lines = [i for i, text in enumerate(Path(file).read_text().splitlines(), 1) if text.rstrip().endswith(marker)]
    assert len(lines) == 1, f"{marker!r} marks {len(lines)} lines"
    return lines[0]
