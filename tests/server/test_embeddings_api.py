"""/v1/embeddings through the official openai client against the live default-model server:
the vectors are the engine's (LLM.embed's: transformers' last hidden state, normalized), in
floats or base64, cut to `dimensions` and normalized again; what cannot be served is a 400."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.engine.pooling import Pooling
from streamer.engine.protocol import ModelInfo
from streamer.server.app import create_app
from tests.server.fakes import NoTokenizer, RecordingEngine

TEXTS = ["The capital of France is", "A quick brown fox", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def want(default_model) -> np.ndarray:
    """transformers' final hidden state at each text's last token, normalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    model = AutoModel.from_pretrained(str(default_model), dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS]
    return np.stack([(r / r.norm()).numpy() for r in rows])


def test_the_client_gets_each_inputs_embedding_in_order(client, want):
    r = client.embeddings.create(model="smol", input=TEXTS)  # (the client asks for base64 and decodes it)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "smol" and r.object == "list"
    got = np.array([d.embedding for d in r.data])
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    floats = client.embeddings.create(model="smol", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, want[0], atol=2e-5)


def test_base64_is_little_endian_float32(live, want):
    r = httpx.post(f"{live.url}/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}, timeout=60)
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, want[1], atol=2e-5)


def test_dimensions_keep_a_prefix_normalized_again_and_token_ids_are_inputs(client, live, want):
    r = client.embeddings.create(model="smol", input=TEXTS[2], dimensions=32)
    head = want[2][:32] / np.linalg.norm(want[2][:32])
    np.testing.assert_allclose(r.data[0].embedding, head, atol=2e-5)
    ids = live.state.info.hf_tokenizer(TEXTS[2])["input_ids"]
    r = client.embeddings.create(model="smol", input=[ids, ids])
    np.testing.assert_allclose([d.embedding for d in r.data], [want[2], want[2]], atol=2e-5)
    raw = httpx.post(f"{live.url}/v1/embeddings", json={"input": TEXTS[2], "normalize": False}, timeout=60).json()
    vec = np.array(raw["data"][0]["embedding"])
    np.testing.assert_allclose(vec / np.linalg.norm(vec), want[2], atol=2e-5)
    assert abs(np.linalg.norm(vec) - 1) > 0.1


def test_truncate_prompt_tokens_embeds_the_inputs_last_tokens(client, live):
    ids = live.state.info.hf_tokenizer(TEXTS[1])["input_ids"]
    cut = client.embeddings.create(model="smol", input=TEXTS[1], extra_body={"truncate_prompt_tokens": 3})
    last = client.embeddings.create(model="smol", input=[ids[-3:]])
    np.testing.assert_allclose(cut.data[0].embedding, last.data[0].embedding, atol=1e-6)
    assert cut.usage.prompt_tokens == 3


@pytest.mark.parametrize(("body", "param", "word"), [
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "int8"),
    ({"input": "x", "dimensions": 100_000}, "dimensions", "100000"),
    ({"input": []}, "input", "empty"),
    ({"input": "x", "model": "nope"}, "model", "nope"),
    ({"input": "x", "truncate_prompt_tokens": 0}, None, "truncate_prompt_tokens"),
    ({"input": [[10**9]]}, None, "outside the vocabulary"),
])
def test_what_cannot_be_served_is_an_error_naming_it(live, body, param, word):
    r = httpx.post(f"{live.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


@pytest.fixture
def mean_pooled() -> Iterator[tuple[RecordingEngine, TestClient]]:
    info = ModelInfo("fake", 4096, 1000, [0], NoTokenizer(),
                     pooling=Pooling(True, "this model's pooling (mean_tokens) is not supported"))
    engine = RecordingEngine(info)
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as c:
        yield engine, c


def test_a_model_whose_pooling_the_engine_lacks_is_refused_before_it_runs(mean_pooled):
    engine, c = mean_pooled
    r = c.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400 and "mean_tokens" in r.json()["error"]["message"]
    assert not engine.sent
