"""Shared fixtures: the default model, tiny random models of other families,
and the transformers oracle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run on CPU only under the interpreter, which must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from streamer.model.default_model import ensure_default_model

    return ensure_default_model()


def make_tiny_model(folder: Path, arch: str, tokenizer_src: Path | None, **overrides) -> Path:
    """A random-weight model of a given family, saved as a plain HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_type = {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3_text",
        "Phi3ForCausalLM": "phi3",
        "MixtralForCausalLM": "mixtral",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "SmolLM3ForCausalLM": "smollm3",
        "Glm4MoeForCausalLM": "glm4_moe",
        "GraniteForCausalLM": "granite",
        "GraniteMoeForCausalLM": "granitemoe",
        "Olmo2ForCausalLM": "olmo2",
        "Olmo3ForCausalLM": "olmo3",
        "OlmoeForCausalLM": "olmoe",
        "CohereForCausalLM": "cohere",
        "Cohere2ForCausalLM": "cohere2",
        "GptOssForCausalLM": "gpt_oss",
        "DeepseekV2ForCausalLM": "deepseek_v2",
        "DeepseekV3ForCausalLM": "deepseek_v3",
    }[arch]
    kw = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    kw.update(overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(folder))
    if tokenizer_src is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_src)).save_pretrained(str(folder))
    return folder


def tiny_family(root: Path, tokenizer_src: Path | None, **kw) -> dict[str, Path]:
    """Qwen2, Qwen3 and Llama-3-style (llama3 rope scaling, tied embeddings) random models."""
    return {
        "qwen2": make_tiny_model(root / "qwen2", "Qwen2ForCausalLM", tokenizer_src, **kw),
        "qwen3": make_tiny_model(root / "qwen3", "Qwen3ForCausalLM", tokenizer_src, **kw),
        "llama3": make_tiny_model(
            root / "llama3",
            "LlamaForCausalLM",
            tokenizer_src,
            **kw,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    }


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model) -> dict[str, Path]:
    return tiny_family(tmp_path_factory.mktemp("tiny"), default_model)


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with the real Qwen tokenizer and a Qwen3-format chat template
    (tests/qwen3.py): the path of tools, tool turns and reasoning through a real template."""
    from tests.qwen3 import FIRST_SPECIAL, IM_END, VOCAB_SIZE, make_qwen3_tokenizer

    root = tmp_path_factory.mktemp("qwen3")
    tok = make_qwen3_tokenizer(root / "tokenizer")
    folder = make_tiny_model(root / "model", "Qwen3ForCausalLM", tok, vocab_size=VOCAB_SIZE,
                             eos_token_id=IM_END, bos_token_id=None, pad_token_id=FIRST_SPECIAL)
    (folder / "generation_config.json").write_text((tok / "generation_config.json").read_text())
    return folder


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve_in_thread(app: Any, **uvicorn_kw: Any) -> Iterator[tuple[int, asyncio.AbstractEventLoop]]:
    """Run a Starlette app with uvicorn on a free loopback port in a background thread;
    yields (port, the server's event loop)."""
    import uvicorn

    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_kw))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1], loop
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
