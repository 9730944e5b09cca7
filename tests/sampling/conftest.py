"""Shared fixtures: the default model's tokenizer and one engine for the whole directory.

The engine is loaded once (session scope, ~7 s on CPU) and shared by the
end-to-end modules; each test leaves it idle and with its settings restored.
"""

from __future__ import annotations

import pytest

from streamer.model.default_model import default_model_dir, is_ready


def _model_dir():
    d = default_model_dir()
    if not is_ready(d):
        pytest.skip(f"the default model is not cached at {d}")
    return d


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
