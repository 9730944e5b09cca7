"""Tool calling with the official openai client against the live default-model server.

Required and named tool choices are constrained by the grammar, so whatever the (small)
model writes, its calls parse and validate against the function's schema; streamed
deltas reassemble to the same call; a tool result goes back into the conversation.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def required(client):
    """A required, single, greedy call: checked by one test, continued by another."""
    return client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=80, temperature=0)


def valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_gives_a_call_that_validates(required):
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    valid(call)
    assert not choice.message.content  # the markup never reaches content


def test_a_named_choice_calls_that_function(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0.8,
                                       seed=3, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and set(valid(call)) >= {"zone"}


def test_streamed_deltas_reassemble_to_the_same_call(client):
    kw = dict(model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert c["id"] is None, "id and name come once, first"
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(w.function.name, json.loads(w.function.arguments)) for w in whole]


def test_a_tool_result_round_trip(client, required):
    first = required
    msg = first.choices[0].message
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temperature": 18}'}]
    r = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_none_gives_text(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_lets_the_model_choose_and_parses_what_it_wrote(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert "<tool_call>" not in (msg.content or "")
    for call in msg.tool_calls or []:
        valid(call)  # a call, once begun, follows its schema
    assert (r.choices[0].finish_reason == "tool_calls") == bool(msg.tool_calls)


@pytest.mark.parametrize("choice, message", [
    ({"type": "function", "function": {"name": "get_stock"}}, "get_stock"),
    ("sometimes", "sometimes"),
])
def test_a_bad_tool_choice_is_a_400_naming_it(client, choice, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8)


def test_tool_choice_without_tools_and_a_double_constraint_are_refused(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
            client.chat.completions.create(model="smol", messages=ASK, tool_choice=choice, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=8)


def test_none_or_auto_without_tools_is_a_plain_reply(client):
    """What clients send by default, and vLLM takes: no tool can be called, so the reply is
    the one without tool_choice."""
    plain = client.chat.completions.create(model="smol", messages=ASK, max_tokens=8, temperature=0).choices[0]
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model="smol", messages=ASK, tool_choice=choice, max_tokens=8,
                                           temperature=0).choices[0]
        assert r.message.content == plain.message.content and not r.message.tool_calls


def test_reserved_chat_template_kwargs_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="may not set tools"):
        client.chat.completions.create(model="smol", messages=ASK, max_tokens=8,
                                       extra_body={"chat_template_kwargs": {"tools": []}})
