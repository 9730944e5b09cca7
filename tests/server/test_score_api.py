"""/v1/score and /v1/rerank (server/score_api.py): a pair's score is the cosine similarity of its
texts' embeddings; score pairs one text with many or two lists pair by pair; rerank orders the
documents by their score against the query, top_n of them; each distinct text is embedded once.
Against the live default model the scores are those of /v1/embeddings' vectors."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from streamer.config import ServerConfig
from streamer.engine.pooling import Pooling
from streamer.engine.protocol import ModelInfo
from streamer.messages import GenerateRequest, RequestOutput
from streamer.server.app import create_app
from tests.server.fakes import NoTokenizer, RecordingEngine

VECTORS = {"query": [1.0, 0.0, 0.0], "near": [2.0, 0.2, 0.0], "far": [0.0, 0.0, 3.0], "middle": [1.0, 1.0, 0.0],
           "opposite": [-1.0, 0.0, 0.0]}


def cosine(a: str, b: str) -> float:
    u, v = np.array(VECTORS[a]), np.array(VECTORS[b])
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


class Embedder(RecordingEngine):
    """Embeds each text as VECTORS says (not normalized: the scores must normalize)."""

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        self.sent.append(request)
        assert request.params.embed
        yield RequestOutput(request.request_id, [], "", finished=True, finish_reason="stop",
                            prompt_tokens=len(request.prompt or ""), embedding=VECTORS[request.prompt or ""])


def serve(info: ModelInfo | None = None) -> Iterator[tuple[Embedder, TestClient]]:
    engine = Embedder(info)
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client


@pytest.fixture
def fake() -> Iterator[tuple[Embedder, TestClient]]:
    yield from serve()


def test_one_text_scores_against_each_of_many_and_lists_pair_by_pair(fake):
    engine, client = fake
    r = client.post("/v1/score", json={"text_1": "query", "text_2": ["near", "far", "query"]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["id"].startswith("score-")
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and all(d["object"] == "score" for d in out["data"])
    np.testing.assert_allclose([d["score"] for d in out["data"]],
                               [cosine("query", "near"), 0.0, 1.0], atol=1e-12)
    assert len(engine.sent) == 3  # (query, near, far: "query" once)
    assert out["usage"] == {"prompt_tokens": len("query") + len("near") + len("far"),
                            "total_tokens": len("query") + len("near") + len("far")}
    r = client.post("/v1/score", json={"text_1": ["near", "middle"], "text_2": ["far", "opposite"]})
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]],
                               [cosine("near", "far"), cosine("middle", "opposite")], atol=1e-12)


def test_rerank_orders_the_documents_most_relevant_first(fake):
    _, client = fake
    docs = ["far", "middle", "near", "opposite"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = client.post(path, json={"query": "query", "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == [2, 1, 0, 3]
        assert [x["document"]["text"] for x in results] == ["near", "middle", "far", "opposite"]
        np.testing.assert_allclose([x["relevance_score"] for x in results],
                                   [cosine("query", d) for d in ("near", "middle", "far", "opposite")], atol=1e-12)
    top = client.post("/v1/rerank", json={"query": "query", "documents": docs, "top_n": 2,
                                          "return_documents": False}).json()["results"]
    assert top == [{"index": 2, "relevance_score": pytest.approx(cosine("query", "near"))},
                   {"index": 1, "relevance_score": pytest.approx(cosine("query", "middle"))}]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/score", {"text_1": ["near", "far"], "text_2": ["query"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": ["query"]}, "text_1"),
    ("/v1/score", {"text_1": "query"}, "text_2"),
    ("/v1/rerank", {"query": "query", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "query", "documents": ["near"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "query", "documents": ["near"], "model": "other"}, "model"),
])
def test_bad_requests_are_a_400_naming_the_field(fake, path, body, param):
    engine, client = fake
    r = client.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code in (400, 404) and (err["param"] == param or f"`{param}`" in err["message"]), r.text
    assert not engine.sent


def test_a_model_without_embeddings_is_refused():
    info = ModelInfo("fake", 4096, 1000, [0], NoTokenizer(), pooling=Pooling(unsupported="mean pooling"))
    for engine, client in serve(info):
        r = client.post("/v1/rerank", json={"query": "query", "documents": ["near"]})
        assert r.status_code == 400 and "mean pooling" in r.json()["error"]["message"] and not engine.sent


def test_the_live_scores_are_the_cosines_of_the_embeddings(live):
    texts = ["The capital of France is Paris.", "Cats sleep a lot.", "Paris is in France."]
    emb = httpx.post(f"{live.url}/v1/embeddings", json={"input": texts}, timeout=60).json()["data"]
    units = [np.array(e["embedding"]) / np.linalg.norm(e["embedding"]) for e in emb]
    want = [float(units[0] @ u) for u in units[1:]]
    score = httpx.post(f"{live.url}/v1/score", json={"text_1": texts[0], "text_2": texts[1:]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    ranked = httpx.post(f"{live.url}/v1/rerank", json={"query": texts[0], "documents": texts[1:]}, timeout=60).json()
    assert [x["index"] for x in ranked["results"]] == sorted(range(2), key=lambda i: -want[i])
