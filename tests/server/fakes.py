"""Fake engines for tests of the server alone: no model. RecordingEngine answers every
request "ok"; Detokenizing answers a fixed text through a real tokenizer and detokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from streamer.engine.detokenizer import Stream
from streamer.engine.protocol import Engine, ModelInfo
from streamer.engine_stats import EngineStats
from streamer.messages import GenerateRequest, RequestOutput, TokenDelta


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


class Detokenizing(RecordingEngine):
    """Answers every request with `text`, tokenized and detokenized under the request's own
    params, token by token, as the engine's detokenizer would."""

    def __init__(self, tok: Any, text: str, name: str = "detokenizing-fake") -> None:
        super().__init__(ModelInfo(name, 4096, len(tok), [0], tok))
        self.tok, self.text = tok, text

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        self.sent.append(request)
        ids = self.tok(self.text, add_special_tokens=False)["input_ids"]
        stream = Stream(self.tok, request.params, asyncio.Queue())
        guess = request.params.prediction  # (tokenized as the engine's tokenizer does: encode_prediction)
        guess = self.tok(guess, add_special_tokens=False)["input_ids"] if isinstance(guess, str) else guess
        for k, t in enumerate(ids):
            out, _ = stream.update(TokenDelta(request.request_id, [t], finish_reason="stop" if k == len(ids) - 1
                                              else None, prompt_tokens=3,
                                              prediction_token_ids=guess if k == 0 else None))
            yield out


def marker_tokenizer(model: Path, markers: tuple[str, ...] | list[str], chat_template: str) -> Any:
    """The model's tokenizer with `markers` as special tokens (each one token, which
    skip_special_tokens drops) and `chat_template` as its template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    tok.chat_template = chat_template
    return tok


def _typed(engine: RecordingEngine) -> Engine:
    return engine  # (mypy: the fake implements the interface the server depends on)


THOUGHT = "<think>\nParis first.\n</think>\n\n"
"""A reasoning block, as Qwen3 writes it (the qwen3 reasoning parser's)."""
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
"""A hermes call."""


def events_of(text: str) -> list[dict[str, Any]]:
    """The data of each event of a named-event SSE body (/v1/responses, /v1/messages); each
    event's name is its data's type."""
    from streamer.sse import named_events

    events = named_events(text)
    assert all(name == data["type"] for name, data in events)
    return [data for _, data in events]
