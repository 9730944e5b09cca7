"""LoRA adapters through the HTTP API (server/state.py check_model, apply_policy): an adapter's
name is a model of /v1/models (its parent: the served model), and a request naming it runs with
it (SamplingParams.lora) on every endpoint that generates or embeds; any other name is a 404."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.engine.protocol import ModelInfo
from streamer.server.app import create_app
from tests.server.fakes import NoTokenizer, RecordingEngine

BODIES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}


@pytest.fixture
def served() -> Iterator[tuple[RecordingEngine, TestClient]]:
    engine = RecordingEngine(ModelInfo("base", 4096, 1000, [0], NoTokenizer(), loras=("sql", "poems")))
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client


def test_the_adapters_are_models_whose_parent_is_the_served_one(served):
    _, client = served
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("base", None), ("sql", "base"), ("poems", "base")]
    assert client.get("/v1/models/poems").json()["parent"] == "base"
    assert client.get("/v1/models/prose").status_code == 404


@pytest.mark.parametrize("path", list(BODIES))
def test_a_request_naming_an_adapter_runs_with_it(served, path):
    engine, client = served
    for model, lora in (("sql", "sql"), ("base", None), (None, None), ("poems", "poems")):
        body = {**BODIES[path], **({"model": model} if model else {})}
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert engine.sent[-1].params.lora == lora, (path, model)
        assert r.json()["model"] == (lora or "base")  # (the answer names the adapter it ran with)
    r = client.post(path, json={**BODIES[path], "model": "prose"})
    assert r.status_code == 404, r.text


def test_an_unknown_model_stays_a_404_without_adapters():
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "model": "sql"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and not engine.sent
