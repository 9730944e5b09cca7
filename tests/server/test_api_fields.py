"""Nothing OpenAI's API defines is silently ignored: each field of completions and chat
completions is implemented, accepted because it needs no effect on one server, or refused
with a 400 that names it (streamer/server/fields.py).

These run the app over a fake engine (no model): what is checked is the server's answer
to the fields, and what it sends the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.messages import GrammarSpec
from streamer.server.app import create_app
from streamer.server.fields import ACCEPTED
from tests.server.fakes import RecordingEngine

MSGS = [{"role": "user", "content": "Hi"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture
def fake() -> Iterator[tuple[RecordingEngine, TestClient]]:
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client


REFUSED = [
    # (path, the body's fields besides prompt / messages, the param named)
    (CMPL, {"suffix": " and so on"}, "suffix"),
    (CMPL, {"best_of": 3}, "best_of"),
    (CMPL, {"best_of": 2, "n": 3}, "best_of"),
    (CMPL, {"max_tokens": 0}, "max_tokens"),
    (CMPL, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"service_tier": "priority"}, "service_tier"),
    (CHAT, {"service_tier": "flex"}, "service_tier"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"verbosity": "high"}, "verbosity"),
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call"),
    (CHAT, {"messages": [*MSGS, {"role": "assistant", "audio": {"id": "audio_1"}}]}, "messages[1].audio"),
    (CHAT, {"messages": [{"role": "function", "name": "f", "content": "42"}]}, "messages[0].role"),
    # other servers' extensions that would change the answer (fields.OTHER_SERVERS_REFUSED)
    (CMPL, {"use_beam_search": True}, "use_beam_search"),
    (CHAT, {"lora_path": "adapters/sql"}, "lora_path"),
    (CMPL, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (CHAT, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
    (CHAT, {"documents": [{"title": "Paris", "text": "The capital."}]}, "documents"),  # (a template without them)
    (CHAT, {"echo": True}, "echo"),
    (CHAT, {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    (CHAT, {"continue_final_message": True, "messages": [*MSGS, {"role": "assistant", "content": "Sure"}]},
     "continue_final_message"),
]


def body_of(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"prompt": "x"} if path == CMPL else {"messages": MSGS}
    return {**base, "max_tokens": 2, **fields}


@pytest.mark.parametrize(("path", "fields", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
def test_an_openai_field_the_server_does_not_implement_is_a_400_naming_it(fake, path, fields, param):
    engine, client = fake
    r = client.post(path, json=body_of(path, fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.rsplit(".", 1)[-1].split("[")[0] in err["message"]
    assert not engine.sent, "refused before anything reached the engine"


def test_the_deprecated_function_calling_fields_point_to_tools(fake):
    _, client = fake
    for fields in ({"functions": []}, {"function_call": "none"}):
        message = client.post(CHAT, json=body_of(CHAT, fields)).json()["error"]["message"]
        assert "deprecated" in message and "tools" in message


ACCEPTED_BODIES = [
    # (path, fields): each key of fields.ACCEPTED appears at least once
    (CMPL, {"user": "u-1"}),
    (CMPL, {"best_of": 1}),
    (CMPL, {"best_of": 2, "n": 2}),
    (CMPL, {"suffix": ""}),
    (CMPL, {"suffix": None, "best_of": None, "echo": False}),
    (CHAT, {"user": "u-1", "safety_identifier": "hash-of-u-1", "prompt_cache_key": "k"}),
    (CHAT, {"store": False, "metadata": {"team": "a"}}),
    (CHAT, {"metadata": {"team": "a"}}),
    (CHAT, {"service_tier": "auto"}),
    (CHAT, {"service_tier": "default"}),
    (CHAT, {"modalities": ["text"]}),
    (CHAT, {"verbosity": "medium"}),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}),
    (CHAT, {"audio": None, "web_search_options": None, "reasoning_effort": None, "functions": None}),
    (CHAT, {"logprobs": True, "top_logprobs": 0}),
]


def test_the_accepted_list_covers_what_the_bodies_below_send():
    sent = {k for _, fields in ACCEPTED_BODIES for k in fields}
    sent |= {f"stream_options.{k}" for _, f in ACCEPTED_BODIES for k in f.get("stream_options", {})}
    assert set(ACCEPTED) <= sent


@pytest.mark.parametrize(("path", "fields"), ACCEPTED_BODIES, ids=[str(i) for i in range(len(ACCEPTED_BODIES))])
def test_an_openai_field_with_no_effect_on_one_server_is_accepted(fake, path, fields):
    engine, client = fake
    r = client.post(path, json=body_of(path, fields))
    assert r.status_code == 200, r.text
    assert len(engine.sent) == fields.get("n", 1)


def test_tool_fields_reach_the_engine(fake):
    engine, client = fake
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"messages": messages, "max_tokens": 2, "tools": [tool], "tool_choice": "auto",
            "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False}}
    assert client.post(CHAT, json=body).status_code == 200
    sent = engine.sent[0]
    assert sent.messages[1]["tool_calls"] == [call]
    assert sent.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert sent.tools == [tool] and sent.chat_template_kwargs == {"enable_thinking": False}
    assert sent.params.grammar.kind == "structural_tag"  # auto: a call, once begun, follows its schema


def test_a_request_chat_template_reaches_the_engine_where_the_server_trusts_it():
    """vLLM's chat_template: refused by default (the test above), and with
    --trust-request-chat-template sent on to render the messages; its variables (documents)
    are checked against it, not against the model's template."""
    engine = RecordingEngine()
    config = ServerConfig(allowed_hosts=("testserver",), trust_request_chat_template=True)
    template = "{% for d in documents %}{{ d.text }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    docs = [{"title": "Paris", "text": "The capital."}]
    with TestClient(create_app(engine, config)) as client:
        r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "chat_template": template, "documents": docs})
        assert r.status_code == 200, r.text
        r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "chat_template": "{{ messages }}",
                                    "documents": docs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert len(engine.sent) == 1
    assert engine.sent[0].chat_template == template and engine.sent[0].documents == docs


def test_truncate_prompt_tokens_reaches_the_engine_but_not_with_echo(fake):
    engine, client = fake
    for path in (CMPL, CHAT):
        assert client.post(path, json=body_of(path, {"truncate_prompt_tokens": 5})).status_code == 200
        assert engine.sent[-1].params.truncate_prompt_tokens == 5
    r = client.post(CMPL, json=body_of(CMPL, {"truncate_prompt_tokens": 5, "echo": True}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_sglangs_names_of_constraints_and_of_keeping_the_stop_string_are_taken(fake):
    """SGLang's regex, ebnf, json_schema and no_stop_trim are its names for guided_regex,
    guided_grammar, guided_json and include_stop_str_in_output; one constraint at most."""
    engine, client = fake
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for path in (CMPL, CHAT):
        for fields, want in (({"regex": "[0-9]+"}, GrammarSpec("regex", "[0-9]+")),
                             ({"ebnf": 'root ::= "yes"'}, GrammarSpec("ebnf", 'root ::= "yes"')),
                             ({"json_schema": schema}, GrammarSpec("json_schema", json.dumps(schema))),
                             ({"json_schema": json.dumps(schema)}, GrammarSpec("json_schema", json.dumps(schema)))):
            assert client.post(path, json=body_of(path, fields)).status_code == 200
            assert engine.sent[-1].params.grammar == want
        assert client.post(path, json=body_of(path, {"no_stop_trim": True})).status_code == 200
        assert engine.sent[-1].params.include_stop
        sent = len(engine.sent)
        r = client.post(path, json=body_of(path, {"regex": "[0-9]+", "guided_regex": "[a-z]+"}))
        assert r.status_code == 400 and "at most one" in r.json()["error"]["message"] and len(engine.sent) == sent


def test_vllms_structural_tag_structures_become_triggered_tags(fake):
    engine, client = fake
    schema = {"type": "object"}
    rf = {"type": "structural_tag", "triggers": ["<f="],
          "structures": [{"begin": "<f=a>", "schema": schema, "end": "</f>"}]}
    assert client.post(CHAT, json=body_of(CHAT, {"response_format": rf})).status_code == 200
    grammar = engine.sent[-1].params.grammar
    assert grammar.kind == "structural_tag" and json.loads(grammar.value) == {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": [
            {"type": "tag", "begin": "<f=a>", "end": "</f>", "content": {"type": "json_schema", "json_schema": schema}}]}}
    bad = {**rf, "structures": [{"begin": "<f=a>", "end": "</f>"}]}
    r = client.post(CHAT, json=body_of(CHAT, {"response_format": bad}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.structures[0]"


def test_a_prediction_reaches_the_engine_as_text(fake):
    engine, client = fake
    for content in ("def f(x):\n    return x", [{"type": "text", "text": "def f(x):\n"},
                                                 {"type": "text", "text": "    return x"}]):
        r = client.post(CHAT, json=body_of(CHAT, {"prediction": {"type": "content", "content": content}}))
        assert r.status_code == 200, r.text
        assert engine.sent[-1].params.prediction == "def f(x):\n    return x"
    for prediction, param in (({"type": "file", "content": "x"}, "prediction.type"),
                              ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content")):
        r = client.post(CHAT, json=body_of(CHAT, {"prediction": prediction}))
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_usage_counts_the_prediction_tokens_the_answer_kept_and_dropped(parsing):
    """Predicted Outputs' usage: accepted_prediction_tokens are the prediction's tokens that
    appear in the answer, in order; rejected_prediction_tokens the others (OpenAI's fields), in
    the response and in a stream's usage chunk; both 0 without a prediction."""
    engine, client = parsing
    tok = engine.tok
    prediction = "alpha beta gamma delta epsilon"
    engine.text = "alpha beta zeta delta epsilon"
    dropped = len(tok(" gamma", add_special_tokens=False)["input_ids"])
    total = len(tok(prediction, add_special_tokens=False)["input_ids"])
    body = {"messages": MSGS, "prediction": {"type": "content", "content": prediction}}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (total - dropped, dropped)
    stream = client.post(CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}).text
    usage = [json.loads(line[6:]).get("usage") for line in stream.splitlines() if line.startswith("data: {")][-1]
    assert usage["completion_tokens_details"] == details
    plain = client.post(CHAT, json={"messages": MSGS}).json()["usage"]["completion_tokens_details"]
    assert (plain["accepted_prediction_tokens"], plain["rejected_prediction_tokens"]) == (0, 0)


def test_an_assistant_refusal_in_the_history_is_its_content(fake):
    engine, client = fake
    messages = [*MSGS, {"role": "assistant", "content": None, "refusal": "I cannot help."}, *MSGS]
    assert client.post(CHAT, json={"messages": messages, "max_tokens": 2}).status_code == 200
    assert engine.sent[0].messages[1] == {"role": "assistant", "content": "I cannot help."}


def test_a_refused_name_inside_a_value_is_no_field(fake):
    engine, client = fake
    # the names are searched in the body's bytes first: a prompt that holds one is still served
    r = client.post(CMPL, json={"prompt": 'say "suffix" and "best_of"', "max_tokens": 2})
    assert r.status_code == 200 and engine.sent[0].prompt == 'say "suffix" and "best_of"'


def test_unknown_keys_that_are_no_openai_fields_are_ignored(fake):
    engine, client = fake
    # other servers' extensions, which clients of those send freely (protocol.py's docstring):
    # those that change nothing, and those that would, set to what this server does anyway
    r = client.post(CHAT, json=body_of(CHAT, {"request_id": "abc", "use_beam_search": False, "length_penalty": 1.0,
                                              "spaces_between_special_tokens": True, "lora_path": None,
                                              "guided_decoding_backend": "xgrammar", "priority": 0}))
    assert r.status_code == 200 and len(engine.sent) == 1


def test_vllms_priority_reaches_the_engine(fake):
    engine, client = fake
    assert client.post(CMPL, json={"prompt": "x", "max_tokens": 2, "priority": -2}).status_code == 200
    assert engine.sent[0].params.priority == -2  # (the engine's tokenizer refuses it under fcfs: test_pipeline)


def test_vllms_include_stop_str_in_output_and_continue_final_message_reach_the_engine(fake):
    engine, client = fake
    assert client.post(CMPL, json={"prompt": "x", "max_tokens": 2, "stop": ["."],
                                   "include_stop_str_in_output": True}).status_code == 200
    assert engine.sent[0].params.include_stop and engine.sent[0].params.stop == ["."]
    messages = [*MSGS, {"role": "assistant", "content": "The answer is"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2, "continue_final_message": True,
                                "add_generation_prompt": False})
    assert r.status_code == 200
    assert engine.sent[1].continue_final_message and not engine.sent[1].add_generation_prompt


def test_best_of_equal_to_n_is_n_samples(fake):
    engine, client = fake
    r = client.post(CMPL, json={"prompt": "x", "max_tokens": 2, "n": 3, "best_of": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3 and len(engine.sent) == 3


def test_a_refused_field_nested_too_deeply_is_a_400(fake):
    _, client = fake
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"messages": [{"role": "user", "content": "x"}], "functions": ' + deep + b"}"
    r = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
