"""Bad input answers 400 in OpenAI's error shape, and never disturbs the requests in flight.

401 (API key) and 503 (queue full, shutting down) need their own server
settings: they are in test_cli.py, against `streamer serve`.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]

BAD = [
    # (path, raw body, param the error names or None)
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "ten"}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": 5}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [], "max_tokens": 4}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a", 1]}), "prompt"),
    ("/v1/completions", json.dumps({"max_tokens": 4}), None),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": -1}), "temperature"),
    ("/v1/completions", json.dumps({"prompt": "x", "top_p": 0}), "top_p"),
    ("/v1/completions", json.dumps({"prompt": "x", "top_k": 0}), None),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 0}), "n"),
    ("/v1/completions", json.dumps({"prompt": "x", "logit_bias": {"999999999": 1}}), "logit_bias"),
    ("/v1/completions", json.dumps({"prompt": "hello " * 9000, "max_tokens": 8}), None),
    ("/v1/completions", json.dumps({"prompt": [10**9], "max_tokens": 8}), None),
    (CHAT, json.dumps({"messages": "hi"}), "messages"),
    (CHAT, json.dumps({"messages": []}), "messages"),
    (CHAT, json.dumps({"messages": [{"content": "no role"}]}), "messages"),
    (CHAT, json.dumps({"messages": MSGS, "stream": "yes"}), "stream"),
    (CHAT, json.dumps({"messages": MSGS, "max_completion_tokens": 0}), "max_completion_tokens"),
    (CHAT, json.dumps({"messages": MSGS, "response_format": {"type": "xml"}}), "response_format"),
    (CHAT, json.dumps({"messages": MSGS, "response_format": {"type": "json_schema"}}), "response_format"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi " * 9000}]}), None),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 4,
                       "stream": True}), None),
    (CHAT, json.dumps({"messages": MSGS, "max_tokens": 4, "guided_regex": "(unclosed"}), None),
]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_400(http, path, body, param):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, param)


def test_context_length_error_is_not_a_stream(http):
    body = {"prompt": "hello " * 9000, "max_tokens": 4, "stream": True}
    r = http.post("/v1/completions", json=body)
    err = assert_openai_error(r, 400)
    assert "context length" in err["message"]


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_bad_input_does_not_disturb_requests_in_flight(live, http):
    result = {}

    def stream():
        body = {"prompt": "Count to fifty:", "max_tokens": 24, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=live.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        result["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    for path, body, _ in BAD[:16]:
        assert http.post(path, content=body, headers={"content-type": "application/json"}).status_code == 400
    t.join(60)
    lines = result["lines"]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    live.wait_idle()


def test_a_grammar_the_vocabulary_cannot_spell_is_a_400_even_after_some_output(http):
    """U+BA78E (private use): the tokenizer has no token sequence for it that the grammar
    engine accepts, so after "É" the grammar admits no token at all. The user's constraint,
    not an engine failure: 400 with the reason (the fuzz found a 500 here), and in a stream
    an error event of the same type, with no refused token in the text."""
    body = {"prompt": "hello", "max_tokens": 16, "temperature": 0, "guided_regex": "\u00c9\U000ba78e4"}
    err = assert_openai_error(http.post("/v1/completions", json=body), 400)
    assert "admits no token of this model's vocabulary after 2 output token(s)" in err["message"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    errors = [e["error"] for e in events if "error" in e]
    assert text == "\u00c9" and len(errors) == 1, events
    assert errors[0]["type"] == "invalid_request_error" and "admits no token" in errors[0]["message"]
