"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (server/lora_api.py) over a real engine
(CPU, a tiny model): a loaded adapter is a model of /v1/models and runs requests naming it; the
engine's refusals are 400s with OpenAI's error body, an unknown name to unload a 404."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.engine.engine import AsyncEngine
from streamer.server.app import create_app
from tests.model.lora_files import make_adapter

COMPLETION = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory):
    base = tiny_models["qwen3"]
    return base, make_adapter(tmp_path_factory.mktemp("lora-api") / "sql", base, ["q_proj", "v_proj"], rank=2,
                              alpha=4, seed=1)


def client(base, allow: bool) -> TestClient:
    engine = AsyncEngine(model=str(base), allow_runtime_lora_updating=allow)
    return TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",), served_model_name="base")))


@pytest.fixture
def served(adapter) -> Iterator[tuple[TestClient, str]]:
    base, folder = adapter
    with client(base, True) as c:
        yield c, str(folder)


def test_a_loaded_adapter_serves_requests_until_it_is_unloaded(served):
    c, folder = served
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": folder})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    assert [(m["id"], m.get("parent")) for m in c.get("/v1/models").json()["data"]] == [("base", None),
                                                                                       ("sql", "base")]
    r = c.post("/v1/completions", json={**COMPLETION, "model": "sql"})
    assert r.status_code == 200 and r.json()["model"] == "sql", r.text
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": folder})
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": folder, "load_inplace": True})
    assert r.status_code == 200, r.text
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id"
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    r = c.post("/v1/completions", json={**COMPLETION, "model": "sql"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"


@pytest.mark.parametrize(("body", "words"), [
    ({"lora_name": "sql", "lora_path": "/nowhere"}, "adapter_config.json"),
    ({"lora_name": "base", "lora_path": "/nowhere"}, "served model"),
    ({"lora_name": "sql"}, "lora_path"),
    ({"lora_name": "sql", "lora_path": "/x", "max_loras": 4}, "max_loras"),
])
def test_what_cannot_be_loaded_is_a_400_naming_why(served, body, words):
    c, _ = served
    r = c.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["base"]


def test_a_server_that_does_not_allow_it_says_how_to(adapter):
    base, folder = adapter
    with client(base, False) as c:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(folder)}),
                           ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
            r = c.post(path, json=body)
            assert r.status_code == 400 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
