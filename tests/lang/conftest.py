"""One in-process engine for the tests of the frontend language, and one live server
(uvicorn with the native routes, on a free loopback port) for RuntimeEndpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from streamer import LLM
from streamer.lang import EngineBackend
from tests.conftest import serve_in_thread


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
    from streamer.config import ServerConfig
    from streamer.engine.engine import AsyncEngine
    from streamer.server.app import create_app

    engine = AsyncEngine(model="default")
    app = create_app(engine, ServerConfig())  # mounts the native routes
    with serve_in_thread(app) as (port, _loop):
        yield f"http://127.0.0.1:{port}"


def line_of(name: str, file: str) -> int:
    """The number of the one line of `file` marked with the comment `#: name`."""
    marker = f"#: {name}"
    lines = [i for i, text in enumerate(Path(file).read_text().splitlines(), 1) if text.rstrip().endswith(marker)]
    assert len(lines) == 1, f"{marker!r} marks {len(lines)} lines"
    return lines[0]
