"""A request that omits temperature, top_p, top_k, repetition_penalty or min_p gets the
model's value from its generation_config.json (`--generation-config auto`, the default), or
streamer's (`--generation-config none`); a value the request gives always stands."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from streamer.config import EngineConfig, ServerConfig
from streamer.engine.protocol import ModelInfo
from streamer.errors import ConfigError
from streamer.messages import GenerateRequest, SamplingParams
from streamer.server.app import create_app
from streamer.server.serve import server_config
from tests.conftest import make_tiny_model, serve_in_thread
from tests.server.fakes import NoTokenizer, RecordingEngine
from tests.server.test_cli import serve_parser

MSGS = [{"role": "user", "content": "Hi"}]
MODEL = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05}
STREAMER = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "min_p": 0.0}


def sampling(params: SamplingParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in MODEL}


@pytest.fixture
def fake() -> Iterator[tuple[RecordingEngine, TestClient, ServerConfig]]:
    engine = RecordingEngine(ModelInfo("fake", 4096, 1000, [0], NoTokenizer(), MODEL))
    config = ServerConfig(allowed_hosts=("testserver",))
    with TestClient(create_app(engine, config)) as client:
        yield engine, client, config


def test_omitted_fields_get_the_model_s_values(fake):
    engine, client, _ = fake
    assert client.post("/v1/chat/completions", json={"messages": MSGS}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    with client.websocket_connect("/v1/chat/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "user", "content": "Hi"})
        while ws.receive_json()["type"] != "done":
            pass
    assert [sampling(q.params) for q in engine.sent] == [MODEL] * 3


def test_a_given_value_stands(fake):
    engine, client, _ = fake
    given = {"temperature": 0.0, "top_p": 0.5, "top_k": -1, "repetition_penalty": 1.0, "min_p": 0.0}
    assert client.post("/v1/chat/completions", json={"messages": MSGS, **given}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "temperature": 0.2}).status_code == 200
    assert sampling(engine.sent[0].params) == given
    assert sampling(engine.sent[1].params) == {**MODEL, "temperature": 0.2}


def test_generation_config_none_keeps_streamer_s_defaults(fake):
    engine, client, config = fake
    config.generation_config = "none"
    assert client.post("/v1/chat/completions", json={"messages": MSGS}).status_code == 200
    assert sampling(engine.sent[0].params) == STREAMER


def test_the_native_api_keeps_its_own_defaults(fake):
    engine, client, _ = fake
    # /generate's sampling_params have explicit defaults, as SGLang's: the model's file does not apply
    assert client.post("/generate", json={"text": "x"}).status_code == 200
    assert sampling(engine.sent[0].params) == STREAMER


def test_the_serve_flag():
    parse = serve_parser().parse_args
    assert server_config(parse([]), EngineConfig()).generation_config == "auto"
    assert server_config(parse(["--generation-config", "none"]), EngineConfig()).generation_config == "none"
    with pytest.raises(SystemExit):
        parse(["--generation-config", "vllm"])
    with pytest.raises(ConfigError):
        ServerConfig(generation_config="yes")


# ---- live: a tiny model whose folder asks for greedy decoding ------------------------------


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory, default_model) -> Iterator[tuple[str, ServerConfig, list[GenerateRequest]]]:
    from streamer.engine.engine import AsyncEngine

    folder = make_tiny_model(tmp_path_factory.mktemp("gen") / "llama", "LlamaForCausalLM", default_model)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.0, "top_k": 0,
                                                               "eos_token_id": 2}))
    engine = AsyncEngine(EngineConfig(model=str(folder), max_model_len=128))
    sent: list[GenerateRequest] = []
    submit = engine.submit

    def recording(req: GenerateRequest) -> Any:
        sent.append(req)
        return submit(req)

    engine.submit = recording  # type: ignore[method-assign]
    config = ServerConfig()
    with serve_in_thread(create_app(engine, config)) as (port, _loop):
        yield f"http://127.0.0.1:{port}", config, sent


def test_a_live_server_samples_with_the_model_s_defaults(greedy_model):
    url, config, sent = greedy_model
    body = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, "seed": 1, "ignore_eos": True}
    texts = [c["text"] for c in httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"]]
    assert [(q.params.temperature, q.params.top_k) for q in sent] == [(0.0, -1)] * 3
    assert len(set(texts)) == 1, "greedy: every choice the same, whatever its seed"
    config.generation_config = "none"
    try:
        texts = [c["text"] for c in httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"]]
    finally:
        config.generation_config = "auto"
    assert sent[-1].params.temperature == 1.0 and len(set(texts)) > 1
