"""Tools and reasoning on a Qwen3-shaped model: the real Qwen tokenizer, a Qwen3-format
chat template (tests/qwen3.py), a tiny random model, served with --reasoning-parser qwen3.

A random model writes nonsense, so what it can show is what the grammar guarantees: hermes
markup forced by tool_choice parses back into calls that validate. What a reasoning model
writes is scripted instead (`Scripted` answers chosen requests with given text pieces), to
check the split of <think> text from the answer, whole and streamed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import jsonschema
import openai
import pytest

from streamer.config import EngineConfig, ServerConfig
from streamer.engine.engine import AsyncEngine
from streamer.messages import GenerateRequest, RequestOutput
from streamer.server.app import create_app
from tests.conftest import serve_in_thread

ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": ARGS}},
         {"type": "function", "function": {"name": "noop"}}]
ASK = [{"role": "user", "content": "Forecast for Lyon?"}]


class Scripted:
    """The real engine, except for requests whose last user message is a key of `script`:
    those get the script's text pieces as their outputs (and are recorded in `seen`)."""

    def __init__(self, real: AsyncEngine) -> None:
        self.real = real
        self.script: dict[str, list[str]] = {}
        self.seen: list[GenerateRequest] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        self.seen.append(request)
        pieces = self.script.get((request.messages or [{}])[-1].get("content", ""))
        if pieces is None:
            async for out in self.real.submit(request):
                yield out
            return
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(request.request_id, [0], piece, finished=last, finish_reason="stop" if last else None,
                                prompt_tokens=5, completion_tokens=k + 1)


@pytest.fixture(scope="module")
def served(qwen3_model) -> Iterator[tuple[openai.OpenAI, Scripted]]:
    engine = Scripted(AsyncEngine(EngineConfig(model=str(qwen3_model))))
    app = create_app(engine, ServerConfig(served_model_name="q", reasoning_parser="qwen3"))  # type: ignore[arg-type]
    with serve_in_thread(app) as (port, _):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120), engine


def test_forced_hermes_markup_parses_back_into_valid_calls(served):
    client, _ = served
    made = 0
    for seed in range(3):
        r = client.chat.completions.create(model="q", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=1.0, seed=seed,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        choice = r.choices[0]
        if choice.finish_reason == "length":
            continue  # (a random model may spend 60 tokens inside one string)
        assert choice.finish_reason == "tool_calls"
        made += 1
        for call in choice.message.tool_calls:
            assert call.function.name in ("forecast", "noop")
            args = json.loads(call.function.arguments)
            if call.function.name == "forecast":
                jsonschema.validate(args, ARGS)
    assert made, "no call finished within 60 tokens"


def test_a_named_call_with_thinking_on_comes_after_the_reasoning(served):
    client, engine = served
    r = client.chat.completions.create(model="q", messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "forecast"}})
    # thinking is on (the template's default): the call's grammar starts after </think>
    assert engine.seen[-1].params.grammar.kind == "structural_tag"
    assert "</think>" in engine.seen[-1].params.grammar.value
    assert r.choices[0].finish_reason in ("length", "tool_calls")


THOUGHT = ["<thi", "nk>\nLyon is in", " France.\n</th", "ink>\n\n", "Sunny", " tomorrow."]


def test_reasoning_is_split_from_the_answer(served):
    client, engine = served
    engine.script["Think first."] = THOUGHT
    r = client.chat.completions.create(model="q", messages=[{"role": "user", "content": "Think first."}])
    msg = r.choices[0].message
    assert msg.content == "Sunny tomorrow." and msg.model_extra["reasoning_content"] == "Lyon is in France."
    # the outputs before the one that ends the reasoning (one token each here) are its tokens
    assert (r.usage.completion_tokens, r.usage.completion_tokens_details.reasoning_tokens) == (6, 3)
    reasoning = content = ""
    for chunk in client.chat.completions.create(model="q", messages=[{"role": "user", "content": "Think first."}],
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
        else:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == 3
    assert (reasoning, content) == ("Lyon is in France.", "Sunny tomorrow.")


def test_with_thinking_off_everything_is_content_and_grammars_apply_at_once(served):
    client, engine = served
    engine.script["No thinking."] = ["Just", " this."]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="q", messages=[{"role": "user", "content": "No thinking."}],
                                       response_format={"type": "json_object"}, extra_body=off)
    assert r.choices[0].message.content == "Just this." and r.usage.completion_tokens_details.reasoning_tokens == 0
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert engine.seen[-1].params.grammar.kind == "json_object"  # not wrapped: no reasoning comes first
    assert engine.seen[-1].chat_template_kwargs == {"enable_thinking": False}
