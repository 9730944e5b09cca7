"""Request limits (server/limits.py) and the native API's decoding: every refusal is a 400
that names the field, the limit and its flag. Without a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from streamer.config import ServerConfig
from streamer.server.limits import CHARS_PER_TOKEN, Limits
from streamer.server.native_api import ChatTemplateBody, GenerateBody, TokenizeBody, prompts
from streamer.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, decode_body
from streamer.server.state import ServerState


def refusal(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.code == "limit_exceeded"
    return e.value


def test_max_prompt_chars_defaults_to_the_context():
    assert Limits(ServerConfig(), 8192).max_prompt_chars == 8192 * CHARS_PER_TOKEN
    assert Limits(ServerConfig(max_prompt_chars=10), 8192).max_prompt_chars == 10


def test_each_refusal_names_the_field_the_limit_and_the_flag():
    lim = Limits(ServerConfig(max_stop=2, max_stop_chars=5, max_logit_bias=3, max_choices=2, max_n=4,
                              max_prompt_chars=10, max_messages=2, max_batch=3), 100)
    cases = [
        (lim.stop, ["a", "b", "c"], None, "stop", "--max-stop"),
        (lim.stop, ["toolong"], None, "stop", "--max-stop-chars"),
        (lim.stop, None, [1, 2, 3], "stop_token_ids", "--max-stop"),
        (lim.choices, ["a", "b", "c"], "guided_choice", "guided_choice", "--max-choices"),
        (lim.batch, 4, "prompt", "prompt", "--max-batch"),
        (lim.prompts, ["hello", "world", "!"], "prompt", "prompt", "--max-prompt-chars"),
    ]
    for fn, a, b, param, flag in cases:
        err = refusal(fn, a, b)
        assert err.param == param and flag in err.message, (err.message, flag)
    err = refusal(lim.messages, [{"role": "user", "content": "x"}] * 3)
    assert err.param == "messages" and "3 messages" in err.message and "limit of 2" in err.message
    err = refusal(lim.messages, [{"role": "user", "content": "0123456"}, {"role": "user", "content": "789ab"}])
    assert "12 characters" in err.message and "--max-prompt-chars" in err.message
    lim.stop(["ab", "cde"], [1, 2])  # at the limits: fine
    lim.prompts(["0123456789", [1] * 1000], "prompt")  # token ids cost no tokenizing
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # counted as its JSON
    assert Limits(ServerConfig(), 100).messages(parts) == len(json.dumps(parts[0]["content"], separators=(",", ":")))


def test_sampling_fields_of_openai_bodies():
    lim = Limits(ServerConfig(max_n=4, max_logit_bias=2), 100)
    body = msgspec.json.decode(json.dumps({"prompt": "x", "n": 5}), type=CompletionRequest)
    assert "--max-n" in refusal(lim.sampling, body).message
    body = msgspec.json.decode(json.dumps({"messages": [], "logit_bias": {"1": 1, "2": 1, "3": 1}}),
                               type=ChatCompletionRequest)
    assert refusal(lim.sampling, body).param == "logit_bias"
    big_n = msgspec.json.decode(json.dumps({"prompt": "x", "n": 1000}), type=CompletionRequest)
    assert big_n.n == 1000  # no bound in the schema any more: --max-n is the one bound


def test_a_request_larger_than_the_queue_is_a_400():
    engine = SimpleNamespace(dead=None, stalled=None, stats=lambda: SimpleNamespace(waiting=0, pages_total=1), max_model_len=64)
    st = ServerState(engine, ServerConfig(max_queue=8))
    st.admit(8)
    err = refusal(st.admit, 9)
    assert "--max-queue" in err.message


# ---- native bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"input_ids": [1, True, 3]},
    {"input_ids": [True]},
    {"input_ids": [[1, 2], [False]]},
    {"input_ids": [1.0, 2]},
    {"text": True},
    {"text": "x", "sampling_params": {"stop_token_ids": [True]}},
    {"text": "x", "sampling_params": {"max_tokens": True}},
])
def test_booleans_and_floats_are_not_token_ids(body):
    with pytest.raises(ApiError) as e:
        decode_body(json.dumps(body).encode(), GenerateBody)
    assert e.value.status == 400 and "Expected" in e.value.message


def test_input_id_shapes():
    def shape(ids):
        return prompts(decode_body(json.dumps({"input_ids": ids}).encode(), GenerateBody))

    assert shape([1, 2]) == ([[1, 2]], False)
    assert shape([[1], [2, 3]]) == ([[1], [2, 3]], True)
    from streamer.errors import RequestError

    for bad in ([1, [2]], [[]], []):
        with pytest.raises(RequestError):
            shape(bad)


@pytest.mark.parametrize("kind", [GenerateBody, TokenizeBody, ChatTemplateBody, CompletionRequest])
@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
                                 b'{"input_ids": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                                 b'{"conversations": [[{"content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]]}",
                                 b"{not json", b"\xff\xfe"])
def test_malformed_or_deep_json_is_a_400(kind, raw):
    with pytest.raises(ApiError) as e:
        decode_body(raw, kind)
    assert e.value.status == 400


def test_every_limit_is_a_serve_flag_that_reaches_the_config():
    import argparse
    import dataclasses

    from streamer.server.serve import LIMIT_FIELDS, add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    assert set(LIMIT_FIELDS) <= {f.name for f in dataclasses.fields(ServerConfig)}
    defaults = p.parse_args([])
    assert all(getattr(defaults, f) == getattr(ServerConfig(), f) for f in LIMIT_FIELDS)
    args = p.parse_args(["--max-stop", "3", "--max-prompt-chars", "99", "--timeout-idle-connection", "2.5",
                         "--allowed-hosts", "a.example, *.b.example", "--allowed-origins", "https://a.example"])
    assert (args.max_stop, args.max_prompt_chars, args.timeout_idle_connection) == (3, 99, 2.5)
    assert args.allowed_hosts == ("a.example", "*.b.example") and args.allowed_origins == ("https://a.example",)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-stop", "0"])
