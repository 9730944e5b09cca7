"""A fake engine for tests of the server alone: no model, every request answered "ok"."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from streamer.engine.protocol import Engine, ModelInfo
from streamer.engine_stats import EngineStats
from streamer.messages import GenerateRequest, RequestOutput


class NoTokenizer:
    """The model's tokenizer as the server holds it: any use fails the test (but reading
    which chat template it has: the server picks the tool-call markup from it)."""

    chat_template = None

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the server used the tokenizer ({name})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the server tokenized")


class RecordingEngine:
    """An Engine that answers every request with "ok" and keeps what it was sent."""

    def __init__(self, info: ModelInfo | None = None) -> None:
        self.info = info or ModelInfo("fake", 4096, 1000, [0], NoTokenizer())
        self.dead: str | None = None
        self.stalled: str | None = None
        self.sent: list[GenerateRequest] = []
        self._ids = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def new_request_id(self) -> str:
        self._ids += 1
        return f"fake-{self._ids}"

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        self.sent.append(request)
        yield RequestOutput(request.request_id, [5], "ok", finished=True, finish_reason="stop",
                            prompt_tokens=3, completion_tokens=1)

    def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 10, 10, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0)


def _typed(engine: RecordingEngine) -> Engine:
    return engine  # (mypy: the fake implements the interface the server depends on)
