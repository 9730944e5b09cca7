"""/v1/models/{model}, stable model cards, an unknown model's 404, GET /version, POST /detokenize,
vLLM's forms of POST /tokenize, /ping and /invocations."""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

import streamer
from streamer.config import ServerConfig
from streamer.server.app import create_app
from tests.server.fakes import RecordingEngine

KEY = "sk-routes"


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_model_card_is_the_listed_one_and_created_is_the_server_start(live, http):
    listed = http.get("/v1/models").json()["data"]
    assert len(listed) == 1
    one = http.get("/v1/models/smol").json()
    assert one == listed[0] and one["object"] == "model" and one["id"] == "smol"
    assert one["created"] == live.state.started
    assert http.get("/v1/models").json()["data"][0]["created"] == one["created"]  # not the time of each call


def test_the_model_s_own_name_stays_an_alias(live, http):
    own = live.state.info.name  # the folder's name, accepted as well as --served-model-name
    assert http.get(f"/v1/models/{own}").json()["id"] == "smol"
    r = http.post("/v1/completions", json={"model": own, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "smol"


@pytest.mark.parametrize("name", ["gpt-4o", "org/some-model", "smol2"])
def test_an_unknown_model_is_404_as_openai_says_it(http, name):
    for r in (http.get(f"/v1/models/{name}"),
              http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1}),
              http.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "Hi"}]})):
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": f"The model `{name}` does not exist.", "type": "invalid_request_error",
                                     "param": "model", "code": "model_not_found"}


def test_the_openai_client_retrieves_the_model(client):
    m = client.models.retrieve("smol")
    assert m.id == "smol" and m.owned_by == "streamer"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_version(http):
    assert http.get("/version").json() == {"version": streamer.__version__}


def test_detokenize_is_tokenize_reversed(http):
    text = "Hello, wörld 👋"
    ids = http.post("/tokenize", json={"text": text}).json()["input_ids"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": [1, *ids, 2]}).json()["prompt"] == f"<|im_start|>{text}<|im_end|>"
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenize_takes_vllms_prompt_and_messages_forms(http):
    """vLLM's /tokenize: a prompt as the engine tokenizes it, messages as a chat request's prompt
    (the count its usage reports), the token strings on request; fields of one form with another
    are refused by name."""
    text = "Hello, wörld"
    ids = http.post("/tokenize", json={"text": text}).json()["input_ids"]
    got = http.post("/tokenize", json={"model": "smol", "prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] > len(ids)
    assert "".join(got["token_strs"]).replace("Ġ", " ").startswith("Hello,")
    assert http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == ids
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    counted = http.post("/tokenize", json={"messages": messages}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"] == len(counted["tokens"])
    plain = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert plain["count"] < counted["count"] and counted["tokens"][:plain["count"]] == plain["tokens"]
    for body, param in (({"text": text, "prompt": text}, None), ({"prompt": text, "tools": []}, "tools"),
                        ({"text": text, "return_token_strs": True}, "return_token_strs"),
                        ({"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
                        ({"prompt": text, "model": "nope"}, "model")):
        r = http.post("/tokenize", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


def test_ping_and_invocations_as_vllm_serves_them(http):
    """SageMaker's /ping is /health (GET or POST, no body); /invocations answers a chat
    completion, completion or embeddings body through that route, told apart by its fields."""
    for r in (http.get("/ping"), http.post("/ping")):
        assert r.status_code == 200 and r.json()["status"] == "ok"
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    cmpl = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
    assert cmpl.status_code == 200 and cmpl.json()["object"] == "text_completion"
    emb = http.post("/invocations", json={"input": "Hi"})
    assert emb.status_code == 200 and emb.json()["data"][0]["object"] == "embedding"
    other = http.post("/invocations", json={"query": "Hi"})
    assert other.status_code == 400 and "messages" in other.json()["error"]["message"]


@pytest.mark.parametrize("tokens", [[49152], [-1], [10**12]])
def test_detokenize_refuses_ids_outside_the_vocabulary(http, tokens):
    r = http.post("/detokenize", json={"tokens": [504, *tokens]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert "outside the vocabulary" in r.json()["error"]["message"]


def test_detokenize_needs_the_api_key_and_version_does_not():
    with TestClient(create_app(RecordingEngine(), ServerConfig(api_keys=(KEY,), allowed_hosts=("testserver",)))) as c:
        assert c.post("/detokenize", json={"tokens": [1]}).status_code == 401
        assert c.get("/v1/models/fake", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/version").json() == {"version": streamer.__version__}
        assert c.get("/v1/models/fake", headers={"Authorization": f"Bearer {KEY}"}).json()["id"] == "fake"


def test_the_openapi_document_has_the_new_routes(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/models/{model}", "/version", "/detokenize", "/tokenize", "/ping", "/invocations"} <= set(paths)
    assert "404" in paths["/v1/chat/completions"]["post"]["responses"]
