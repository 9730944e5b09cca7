"""/v1/models/{model}, stable model cards, an unknown model's 404, GET /version and POST /detokenize."""

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
    assert {"/v1/models/{model}", "/version", "/detokenize", "/tokenize"} <= set(paths)
    assert "404" in paths["/v1/chat/completions"]["post"]["responses"]
