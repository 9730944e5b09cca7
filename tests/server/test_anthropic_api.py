"""/v1/messages: Anthropic's Messages API, run as a chat completion (server/anthropic_api.py).

The request reaches the engine as the chat request that says the same (system, tool results,
tool uses, thinking, tools, tool_choice, stop sequences); the answer is content blocks in the
order written, and a stream's events rebuild it exactly. Errors have Anthropic's shape. Against
the live default model, through the official anthropic client: the text is chat's for the same
conversation, a forced tool call validates, stop sequences are reported, count_tokens counts
the prompt the engine runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.server.app import create_app
from tests.server.fakes import CALL, THOUGHT, RecordingEngine, events_of

PATH = "/v1/messages"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def fake() -> Iterator[tuple[RecordingEngine, TestClient]]:
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",), api_keys=("k",)))) as client:
        client.headers["x-api-key"] = "k"  # (Anthropic's clients send the key so)
        yield engine, client


def test_a_conversation_reaches_the_engine_as_chat_messages(fake):
    engine, client = fake
    body = {"max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"],
            "temperature": 0.5, "top_k": 4, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no data", "is_error": True}]}]}
    r = client.post(PATH, json=body)
    assert r.status_code == 200, r.text
    (sent,) = engine.sent
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert sent.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "toolu_1", **call}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_2", **call}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
    ]
    p = sent.params
    assert (p.max_tokens, p.stop, p.temperature, p.top_k) == (7, ["END"], 0.5, 4) and not p.fill_context
    out = r.json()
    assert out["type"] == "message" and out["id"].startswith("msg_") and out["role"] == "assistant"
    assert out["content"] == [{"type": "text", "text": "ok"}] and out["stop_reason"] == "end_turn"
    assert out["usage"] == {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 0,
                            "cache_creation_input_tokens": 0}


def test_tools_and_tool_choice_reach_the_engine_in_chat_shape(fake):
    engine, client = fake
    chat_tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}}
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"},
                   {"type": "any", "disable_parallel_tool_use": True}):
        r = client.post(PATH, json={"max_tokens": 5, "messages": USER, "tools": [TOOL], "tool_choice": choice})
        assert r.status_code == 200, r.text
        assert engine.sent[-1].tools == [chat_tool] and engine.sent[-1].params.grammar is not None
    assert client.post(PATH, json={"max_tokens": 5, "messages": USER, "tools": [TOOL],
                                   "tool_choice": {"type": "none"}}).status_code == 200
    assert engine.sent[-1].params.grammar is None
    client.post(PATH, json={"max_tokens": 5, "messages": USER, "thinking": {"type": "disabled"}})
    assert engine.sent[-1].chat_template_kwargs == {"enable_thinking": False}
    client.post(PATH, json={"max_tokens": 5, "messages": USER, "thinking": {"type": "adaptive"}})
    assert engine.sent[-1].chat_template_kwargs is None


def test_output_config_format_constrains_and_ids_and_cache_control_pass(fake):
    engine, client = fake
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cached = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]
    r = client.post(PATH, json={"max_tokens": 5, "messages": cached, "cache_control": {"type": "ephemeral"},
                                "output_config": {"format": {"type": "json_schema", "schema": schema}},
                                "metadata": {"user_id": "u"}, "workspace_id": "w", "user_profile_id": "p",
                                "speed": "standard", "service_tier": "auto"})
    assert r.status_code == 200, r.text
    grammar = engine.sent[-1].params.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.value) == schema


@pytest.mark.parametrize(("fields", "word"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"thinking": {"type": "between_tools"}}, "between_tools"),
    ({"output_config": {"effort": "high"}}, "effort"),
    ({"output_config": {"format": {"type": "regex"}}}, "json_schema"),
    ({"speed": "fast"}, "speed"),
    ({"inference_geo": "eu"}, "inference_geo"),
    ({"diagnostics": {"previous_message_id": None}}, "diagnostics"),
    ({"container": "c_1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "https://x"}]}, "mcp_servers"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": []}, "empty"),
    ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "name"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": "nope"}, "nope"),
])
def test_what_is_not_supported_is_an_anthropic_error_naming_it(fake, fields, word):
    engine, client = fake
    r = client.post(PATH, json={"max_tokens": 5, "messages": USER, **fields})
    assert r.status_code in (400, 404), r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert word in body["error"]["message"]
    assert not engine.sent


def test_the_key_is_checked_from_x_api_key(fake):
    _, client = fake
    r = client.post(PATH, json={"max_tokens": 5, "messages": USER}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401


# ---- blocks and events, over a real tokenizer -----------------------------------------------

def rebuilt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a client gathers from the events."""
    blocks: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = dict(e["content_block"])
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[d["type"]]
            b[key] = b.get(key, "") + d[key if key != "partial" else "partial_json"]
    for b in blocks.values():
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial"))
    return [blocks[k] for k in sorted(blocks)]




@pytest.mark.parametrize("answer", [THOUGHT + "Checking. " + CALL, THOUGHT + "Sunny.", CALL + CALL, "Plain."],
                         ids=["all", "text", "two-calls", "plain"])
def test_a_stream_rebuilds_the_whole_message(parsing, answer):
    engine, client = parsing
    engine.text = answer
    body = {"max_tokens": 100, "messages": USER, "tools": [TOOL]}
    whole = client.post(PATH, json=body).json()
    events = events_of(client.post(PATH, json={**body, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"] == 3
    strip = [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert [{k: v for k, v in b.items() if k != "id"} for b in rebuilt(events)] == strip
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"]
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(whole["content"])


def test_omitted_thinking_comes_as_empty_blocks(parsing):
    engine, client = parsing
    engine.text = THOUGHT + "Sunny."
    body = {"max_tokens": 100, "messages": USER, "thinking": {"type": "adaptive", "display": "omitted"}}
    out = client.post(PATH, json=body).json()
    assert out["content"] == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "Sunny."}]
    events = events_of(client.post(PATH, json={**body, "stream": True}).text)
    assert not [e for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"]


def test_thinking_text_and_tool_use_are_blocks_in_the_order_written(parsing):
    engine, client = parsing
    engine.text = THOUGHT + "Checking. " + CALL
    out = client.post(PATH, json={"max_tokens": 100, "messages": USER, "tools": [TOOL]}).json()
    thinking, text, use = out["content"]
    assert thinking == {"type": "thinking", "thinking": "Paris first.", "signature": ""}
    assert text == {"type": "text", "text": "Checking."}
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    assert out["stop_reason"] == "tool_use"


# ---- the live default model, through the official client --------------------------------------


@pytest.fixture(scope="module")
def client(live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60)


def test_the_text_is_chats_for_the_same_conversation(client, live):
    import openai

    chat = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused").chat.completions.create(
        model="smol", messages=[{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=12, temperature=0)
    m = client.messages.create(model="smol", system="You are brief.", messages=[{"role": "user", "content": "Hi"}],
                               max_tokens=12, extra_body={"temperature": 0})
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.output_tokens == chat.usage.completion_tokens
    count = client.messages.count_tokens(model="smol", system="You are brief.",
                                         messages=[{"role": "user", "content": "Hi"}])
    assert count.input_tokens == chat.usage.prompt_tokens


def test_a_forced_call_validates_streams_the_same_and_its_result_goes_back_in(client):
    kw: dict[str, Any] = {"model": "smol", "max_tokens": 60, "extra_body": {"temperature": 0}, "tools": [TOOL]}
    m = client.messages.create(messages=USER, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(messages=USER, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                **kw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
    after = client.messages.create(messages=history, tool_choice={"type": "none"}, **kw)
    assert after.content[0].type == "text" and after.content[0].text


def test_a_stop_sequence_is_reported(client):
    free = client.messages.create(model="smol", messages=[{"role": "user", "content": "Count to ten."}],
                                  max_tokens=30, extra_body={"temperature": 0})
    word = free.content[0].text.split()[2]
    m = client.messages.create(model="smol", messages=[{"role": "user", "content": "Count to ten."}],
                               max_tokens=30, extra_body={"temperature": 0}, stop_sequences=["never", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text
