"""/v1/responses: OpenAI's Responses API, run as a chat completion (server/responses_api.py).

A body's instructions, input items, function tools and text.format reach the engine as the
chat request that says the same; what is not supported (conversation, hosted tools, images) is
a 400 naming it (storage, previous_response_id and background: test_response_store.py). The output is the chat output's split as items (reasoning, message, calls), and
a stream's events rebuild exactly the whole response. Against the live default model, through
the official client: the text is chat's for the same conversation, required calls validate,
and a call's result goes back in as input.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.server.app import create_app
from tests.server.fakes import CALL, THOUGHT, RecordingEngine, events_of

PATH = "/v1/responses"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}


@pytest.fixture
def fake() -> Iterator[tuple[RecordingEngine, TestClient]]:
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client


# ---- the request, as the engine gets it --------------------------------------------------


def test_instructions_and_input_items_become_the_chat_messages(fake):
    engine, client = fake
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    body = {"instructions": "Be brief.", "max_output_tokens": 5, "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        call,
        {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer "}, {"type": "input_text",
                                                                                       "text": "now."}]},
    ]}
    r = client.post(PATH, json=body)
    assert r.status_code == 200, r.text
    (sent,) = engine.sent
    calls = [{"id": f"call_{k}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
             for k, args in ((1, '{"city": "Paris"}'), (2, '{"city": "Rome"}'))]
    assert sent.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        # the reasoning goes with the answer after it, and that answer's calls join its message
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "developer", "content": "Answer now."},
    ]
    assert sent.params.max_tokens == 5 and not sent.params.fill_context


def test_a_string_input_is_one_user_message_and_no_max_output_tokens_fills_the_context(fake):
    engine, client = fake
    assert client.post(PATH, json={"input": "Hi", "temperature": 0.5, "top_k": 3, "seed": 7}).status_code == 200
    (sent,) = engine.sent
    assert sent.messages == [{"role": "user", "content": "Hi"}]
    assert sent.params.fill_context and (sent.params.temperature, sent.params.top_k, sent.params.seed) == (0.5, 3, 7)


def test_a_call_without_an_assistant_message_before_it_opens_one(fake):
    engine, client = fake
    body = {"input": [{"role": "user", "content": "Paris?"},
                      {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c", "output": "sunny"}], "tools": [TOOL]}
    assert client.post(PATH, json=body).status_code == 200
    assert engine.sent[0].messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}


def test_function_tools_reach_the_engine_in_chat_shape_and_choices_constrain(fake):
    engine, client = fake
    chat_tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}}
    for choice, kind in (("auto", "structural_tag"), ("required", None), ({"type": "function", "name": "get_weather"},
                                                                          None)):
        assert client.post(PATH, json={"input": "Paris?", "tools": [TOOL], "tool_choice": choice}).status_code == 200
        sent = engine.sent[-1]
        assert sent.tools == [chat_tool]
        assert sent.params.grammar is not None and (kind is None or sent.params.grammar.kind == kind)
    assert client.post(PATH, json={"input": "Paris?", "tools": [TOOL], "tool_choice": "none"}).status_code == 200
    assert engine.sent[-1].params.grammar is None


def test_text_format_constrains_as_response_format_does(fake):
    engine, client = fake
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    assert client.post(PATH, json={"input": "2+2?", "text": fmt}).status_code == 200
    grammar = engine.sent[-1].params.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.value) == schema
    assert client.post(PATH, json={"input": "2+2?", "text": {"format": {"type": "json_object"}}}).status_code == 200
    assert engine.sent[-1].params.grammar.kind == "json_object"
    assert client.post(PATH, json={"input": "2+2?", "text": {"format": {"type": "text"}}}).status_code == 200
    assert engine.sent[-1].params.grammar is None


REFUSED = [
    # (the body's fields besides input, the param named, a word of the message)
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort", "reads no reasoning_effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "never summarized"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary", "never summarized"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"),
    ({"service_tier": "flex"}, "service_tier", "service_tier"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "/v1/completions"),
    ({"bad_words": ["x"]}, "bad_words", "WebSocket turns"),
    ({"regex": "[0-9]+"}, "regex", "WebSocket turns"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "/v1/chat/completions"),
    ({"n": 2}, "n", "one output"),
    ({"max_tokens": 5}, "max_tokens", "max_output_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [{"type": "function"}]}, "tools[0].name", "name"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "allowed_tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]", "reasoning.encrypted_content"),
    ({"include": ["message.output_text.logprobs"], "tools": [TOOL]}, "include", "logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema", "schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "grammar"),
    ({"text": {"verbosity": "high"}}, "text.verbosity", "verbosity"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "previous_response_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "web_search_call"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "tool"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0]", "output"),
]


@pytest.mark.parametrize(("fields", "param", "word"), REFUSED, ids=[p for _, p, _ in REFUSED])
def test_what_is_not_supported_is_a_400_naming_it(fake, fields, param, word):
    engine, client = fake
    r = client.post(PATH, json={"input": "Hi", **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err
    assert not engine.sent, "refused before anything reached the engine"


def test_the_response_echoes_the_request_and_counts_usage(fake):
    engine, client = fake
    body = {"input": "Hi", "instructions": "Be kind.", "max_output_tokens": 9, "metadata": {"team": "a"},
            "user": "u-1", "store": False, "truncation": "disabled", "background": False, "temperature": 0.3,
            "safety_identifier": "h", "prompt_cache_key": "k"}
    r = client.post(PATH, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("resp_") and out["object"] == "response" and out["status"] == "completed"
    assert (out["instructions"], out["max_output_tokens"], out["metadata"], out["user"]) == \
        ("Be kind.", 9, {"team": "a"}, "u-1")
    assert out["temperature"] == 0.3 and out["store"] is False and out["text"] == {"format": {"type": "text"}}
    (item,) = out["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_") and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}]
    assert out["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 4}


# ---- output items and events, over a real tokenizer -------------------------------------

def rebuilt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items that a client gathers from the deltas (ids, names and order as added)."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            item = e["item"]
            items[e["output_index"]] = {"type": item["type"], "id": item["id"], "text": "",
                                        **({"name": item["name"]} if item["type"] == "function_call" else {})}
        elif kind.endswith(".delta"):
            assert items[e["output_index"]]["id"] == e["item_id"]
            items[e["output_index"]]["text"] += e["delta"]
    return [items[k] for k in sorted(items)]


def items_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for item in response["output"]:
        text = {"message": lambda i: i["content"][0]["text"], "reasoning": lambda i: i["content"][0]["text"],
                "function_call": lambda i: i["arguments"]}[item["type"]](item)
        out.append({"type": item["type"], "id": item["id"], "text": text,
                    **({"name": item["name"]} if item["type"] == "function_call" else {})})
    return out




@pytest.mark.parametrize("answer", [THOUGHT + "Checking. " + CALL, THOUGHT + "Sunny, 21 C.", CALL + CALL,
                                    "No reasoning here."], ids=["all", "text", "two-calls", "plain"])
def test_a_stream_rebuilds_the_whole_response(parsing, answer):
    engine, client = parsing
    engine.text = answer
    body = {"input": "Weather in Paris?", "tools": [TOOL]}
    whole = client.post(PATH, json=body).json()
    r = client.post(PATH, json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    last = events[-1]
    assert last["type"] == "response.completed" and last["response"]["status"] == "completed"
    # the deltas spell the final items, which are the whole response's (but for the fresh ids)
    assert rebuilt(events) == items_of(last["response"])
    strip = [{k: v for k, v in i.items() if k != "id"} for i in items_of(whole)]
    assert [{k: v for k, v in i.items() if k != "id"} for i in items_of(last["response"])] == strip
    assert last["response"]["usage"] == whole["usage"]
    for e in events:  # each item's events open and close it
        if e["type"] == "response.output_item.done":
            assert e["item"]["status"] == "completed"


def test_reasoning_message_and_call_are_items_in_the_order_written(parsing):
    engine, client = parsing
    engine.text = THOUGHT + "Checking. " + CALL
    out = client.post(PATH, json={"input": "Weather in Paris?", "tools": [TOOL]}).json()
    reasoning, message, call = out["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Paris first."}]
    assert message["content"][0]["text"] == "Checking."
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    usage = out["usage"]
    thought = len(engine.tok(THOUGHT, add_special_tokens=False)["input_ids"])
    # the tokens until the reasoning ended: all of the block but its closing tag's last pieces
    assert thought - 6 <= usage["output_tokens_details"]["reasoning_tokens"] < thought
    assert usage["output_tokens"] > thought


def test_a_cut_answer_is_incomplete(parsing):
    _, client = parsing
    # (the fake engine ends on "stop"; a "length" ending is fed to the builder itself)
    from streamer.messages import RequestOutput
    from streamer.server.chat_output import ChatSetup
    from streamer.server.openai_output import Formatter
    from streamer.server.responses import ResponseObject
    from streamer.server.responses_output import ResponseBuilder

    head = ResponseObject("resp_x", 0, "in_progress", "m", [], None, 4, True, 1.0, 1.0, 0, "auto", [], {}, {}, None)
    b = ResponseBuilder(head, ChatSetup(), Formatter(client.app.state.server), logprobs=False, streaming=True)
    b.opening()
    b.feed(RequestOutput("x", [1, 2], "Sunny and", prompt_tokens=3, completion_tokens=2))
    b.feed(RequestOutput("x", [3], " warm", finished=True, finish_reason="length", prompt_tokens=3,
                         completion_tokens=3))
    events = events_of(b.take().decode())
    assert events[-1]["type"] == "response.incomplete"
    assert head.status == "incomplete" and head.incomplete_details.reason == "max_output_tokens"
    (item,) = head.output
    assert item.status == "incomplete" and item.content[0].text == "Sunny and warm"
    assert head.usage.output_tokens == 3


# ---- the live default model, through the official client ---------------------------------


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_text_is_chats_for_the_same_conversation(client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    r = client.responses.create(model="smol", instructions="You are brief.", input="Name a color.",
                                max_output_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")


def test_a_required_call_validates_streams_the_same_and_its_result_goes_back_in(client):
    ask = "What is the weather in Paris?"
    kwargs: dict[str, Any] = {"model": "smol", "tools": [TOOL], "max_output_tokens": 60, "temperature": 0}
    r = client.responses.create(input=ask, tool_choice="required", parallel_tool_calls=False, **kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    stream = client.responses.create(input=ask, tool_choice="required", parallel_tool_calls=False, stream=True,
                                     **kwargs)
    events = list(stream)
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    history = [{"role": "user", "content": ask},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    after = client.responses.create(input=history, tool_choice="none", **kwargs)
    (message,) = after.output
    assert message.type == "message" and after.output_text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(client.responses.create(model="smol", input="Tell me a story.", max_output_tokens=5,
                                          temperature=0, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 5
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == last.response.output[0].content[0].text


def test_a_stored_response_is_continued_fetched_listed_and_deleted(client):
    """Through the official client: previous_response_id continues the conversation as the same
    conversation sent whole does (greedy), and the stored turn reads back as it was answered."""
    first = client.responses.create(model="smol", input="Name a color.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="smol", input="And a fruit?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    whole = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And a fruit?"}]
    sent_whole = client.responses.create(model="smol", input=whole, max_output_tokens=8, temperature=0, store=False)
    assert second.output_text == sent_whole.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens == sent_whole.usage.input_tokens
    again = client.responses.retrieve(second.id)
    assert again.model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert items.data[-1].content[0].text == "And a fruit?" and items.data[-1].id.startswith("msg_")
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(sent_whole.id)  # (store false)


def test_a_background_response_is_polled_to_the_same_answer(client):
    kwargs: dict[str, Any] = {"model": "smol", "input": "Name a fruit.", "max_output_tokens": 8, "temperature": 0}
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background
    for _ in range(2000):  # (a client polling; the answer takes well under a second)
        polled = client.responses.retrieve(queued.id)
        if polled.status not in ("queued", "in_progress"):
            break
    assert polled.status in ("completed", "incomplete")
    assert polled.output_text == client.responses.create(**kwargs).output_text
    assert client.responses.cancel(queued.id).status == polled.status  # (ended: as it is)
