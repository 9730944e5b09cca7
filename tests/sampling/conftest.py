"""Shared fixtures: the default model's tokenizer and one engine for the whole directory.

The engine is loaded once (session scope, ~7 s on CPU) and shared by the
end-to-end modules; each test leaves it idle and with its settings restored.
"""

from __future__ import annotations

import pytest

from streamer.model.default_model import ensure_default_model


def _model_dir():
    return ensure_default_model()


@pytest.fixture(scope="session")
def model_dir():
    return _model_dir()


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def llm(model_dir):
    from streamer.engine.llm import LLM

    engine = LLM("default")
    yield engine
    engine.close()
