"""One request pipeline: every endpoint maps its body once into engine requests, admits them
once, and never tokenizes. What needs the prompt's length (an omitted max_tokens) reaches
the engine unresolved (fill_context), and the engine resolves it.

The first tests run the app over a fake engine (no model) that records what it is sent;
the last ones run a real engine of a small context behind a real server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from websockets.asyncio.client import connect

from streamer.config import EngineConfig, ServerConfig
from streamer.messages import GrammarSpec, SamplingParams
from streamer.server.app import create_app
from streamer.server.state import ServerState
from tests.conftest import serve_in_thread
from tests.server.fakes import RecordingEngine

MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def fake(monkeypatch) -> Iterator[tuple[RecordingEngine, TestClient, list[int]]]:
    admitted: list[int] = []
    admit = ServerState.admit

    def counting(self: ServerState, n: int) -> None:
        admitted.append(n)
        admit(self, n)

    monkeypatch.setattr(ServerState, "admit", counting)
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client, admitted


def test_a_chat_without_max_tokens_reaches_the_engine_as_messages_to_fill_the_context(fake):
    engine, client, admitted = fake
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "n": 2, "seed": 7})
    assert r.status_code == 200, r.text
    assert admitted == [2], "one admission for the HTTP request, of both choices"
    assert [q.request_id.rsplit("-", 1)[1] for q in engine.sent] == ["0", "1"]
    for i, q in enumerate(engine.sent):
        assert q.messages == MSGS and q.prompt is None and q.prompt_token_ids is None
        assert q.params.fill_context and q.params.seed == 7 + i


def test_a_given_max_tokens_goes_as_it_is(fake):
    engine, client, admitted = fake
    assert client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": ["a", "b"]}).status_code == 200
    chat, *completions = engine.sent
    assert chat.params.max_tokens == 5 and not chat.params.fill_context
    assert [q.prompt for q in completions] == ["a", "b"]
    assert all(q.params.max_tokens == 16 and not q.params.fill_context for q in completions)
    assert admitted == [1, 2]


def test_a_websocket_turn_without_max_tokens_fills_the_context(fake):
    engine, client, admitted = fake
    with client.websocket_connect("/v1/chat/ws") as ws:
        assert ws.receive_json()["type"] == "session"
        ws.send_json({"type": "user", "content": "Hi"})
        assert ws.receive_json() == {"type": "delta", "text": "ok"}
        assert ws.receive_json()["type"] == "done"
        ws.send_json({"type": "user", "content": "again", "max_tokens": 3})
        while ws.receive_json()["type"] != "done":
            pass
    first, second = engine.sent
    assert first.messages == MSGS and first.params.fill_context
    assert second.messages == [*MSGS, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    assert second.params.max_tokens == 3 and not second.params.fill_context
    assert admitted == [1, 1]


def test_native_sampling_params_map_by_name(fake):
    engine, client, admitted = fake
    sp: dict[str, Any] = {"max_tokens": 7, "min_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1,
          "presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1, "seed": 4,
          "stop": "x", "stop_token_ids": [9], "ignore_eos": True, "skip_special_tokens": False,
          "regex": "a+", "cache_salt": "s", "timeout": 30.0}
    body = {"input_ids": [1, 2], "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2,
            "prompt_logprobs_from": 1}
    assert client.post("/generate", json=body).status_code == 200
    (q,) = engine.sent
    assert q.prompt_token_ids == [1, 2] and admitted == [1]
    same = {k: v for k, v in sp.items() if k not in ("stop", "regex")}
    assert q.params == SamplingParams(**same, stop=["x"], grammar=GrammarSpec("regex", "a+"), logprobs=2,
                                      prompt_logprobs_from=1)
    assert client.post("/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": "b"}}).json() \
        ["error"]["message"] == "give at most one of regex, json_schema, json_object, ebnf, choices"
    assert client.post("/generate", json={"text": "x"}).status_code == 200
    assert engine.sent[-1].params == SamplingParams(max_tokens=128)  # the native default


# ---- a real engine of a 64-token context --------------------------------------------------


@pytest.fixture(scope="module")
def small(default_model) -> Iterator[str]:
    from streamer.engine.engine import AsyncEngine

    app = create_app(AsyncEngine(EngineConfig(model="default", max_model_len=64)), ServerConfig())
    with serve_in_thread(app) as (port, _loop):
        yield f"http://127.0.0.1:{port}"


def test_the_engine_gives_a_chat_without_max_tokens_the_room_left(small):
    body = {"messages": MSGS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(small + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 64 - usage["prompt_tokens"] > 0
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_allowed_token_ids_hold_the_answer_to_those_tokens(small, default_model):
    """vLLM's allowed_token_ids, through the API to the real sampler: every token drawn (at
    temperature 1) is one of them; ids outside the vocabulary, a grammar beside them and a set
    that min_tokens would empty (EOS alone) are 400s naming them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    words = [" yes", " no", " maybe"]
    ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in words]
    body = {"prompt": "Answer:", "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "allowed_token_ids": ids, "logprobs": 0}
    r = httpx.post(small + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 12 and set(tokens) <= set(words), tokens
    for extra, word in (({"allowed_token_ids": [10**6]}, "allowed_token_ids must be at most 49152 token ids in [0, "),
                        ({"guided_choice": ["a"]}, "cannot be combined with a grammar"),
                        ({"allowed_token_ids": [2], "min_tokens": 1, "ignore_eos": False}, "which min_tokens bans")):
        r = httpx.post(small + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_bad_words_keep_a_word_out_of_the_answer(small, default_model):
    """vLLM's bad_words through the API (tests/engine/test_bad_words.py: what they ban, against
    transformers); a set that bans every allowed token, a blank word and more words than --max-stop
    are 400s naming them."""
    from transformers import AutoTokenizer

    body = {"prompt": "Max the dog loves to play in the park. Every day, Max", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    plain = httpx.post(small + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert " favorite dog" in plain and " Max" in plain, plain
    r = httpx.post(small + "/v1/completions", json={**body, "bad_words": ["favorite dog", "Max"]}, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert " favorite dog" not in text and " Max" not in text and text != plain, text
    (the,) = AutoTokenizer.from_pretrained(str(default_model))(" the", add_special_tokens=False)["input_ids"]
    for extra, word in (({"bad_words": ["the"], "allowed_token_ids": [the]}, "ban every token of allowed_token_ids"),
                        ({"bad_words": [" "]}, "bad_words must not hold an empty"),
                        ({"bad_words": [f"w{i}" for i in range(17)]}, "bad words")):
        r = httpx.post(small + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_a_priority_needs_the_priority_policy(small):
    """vLLM's priority: a first-come-first-served engine (the default) refuses any but 0, naming
    the flag that turns priorities on (tests/engine/scheduler/test_policy.py: what they do)."""
    body = {"prompt": "Hi", "max_tokens": 2, "priority": 0}
    assert httpx.post(small + "/v1/completions", json=body, timeout=60).status_code == 200
    r = httpx.post(small + "/v1/completions", json={**body, "priority": -3}, timeout=60)
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"], r.text


def test_an_engine_with_the_priority_policy_takes_priorities(default_model):
    from streamer.engine.llm import LLM

    with LLM(str(default_model), scheduling_policy="priority", max_model_len=64) as llm:
        outs = llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=3, priority=p, ignore_eos=True) for p in (3, -1)])
    assert [(o.error, o.completion_tokens) for o in outs] == [(None, 3), (None, 3)]


def test_a_prompt_that_leaves_no_room_and_max_tokens_past_the_context_are_refused(small):
    long = [{"role": "user", "content": "hello " * 80}]
    r = httpx.post(small + "/v1/chat/completions", json={"messages": long}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"].startswith("this model's maximum context length is 64 tokens; the prompt has ")
    assert err["message"].endswith(" tokens") and "max_tokens" not in err["message"]
    r = httpx.post(small + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 60}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in err["message"] and "max_tokens is 60" in err["message"]
    asyncio.run(_turn_refused(small.replace("http", "ws", 1) + "/v1/chat/ws", "hello " * 80))


async def _turn_refused(url: str, content: str) -> None:
    async with connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session"
        await ws.send(json.dumps({"type": "user", "content": content}))
        m = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert m["type"] == "error", m
        assert m["message"].startswith("this model's maximum context length is 64 tokens; the prompt has ")
