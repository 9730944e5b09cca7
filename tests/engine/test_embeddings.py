"""Embeddings (SamplingParams.embed, LLM.embed): a prompt's embedding is transformers' final
hidden state at its last token (last-token pooling), L2-normalized as the model's folder
says, whatever the batch, the chunking, the page size or the cache; generation batched
beside it is unchanged. engine/pooling.py reads the folder's sentence-transformers files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.engine.pooling import Pooling, pooling_config
from streamer.errors import RequestError
from tests.conftest import make_tiny_model

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived an old "
           "clockmaker who repaired every clock in town, and his daughter",
           "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def reference(folder: Path, prompts: list[str | list[int]]) -> list[torch.Tensor]:
    """transformers' last hidden state (after the final norm) at each prompt's last token."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"] if isinstance(p, str) else p])
            out.append(model(input_ids=ids).last_hidden_state[0, -1])
    return out


def close(got: list[list[float]], want: list[torch.Tensor], normalize: bool = True) -> None:
    for g, w in zip(got, want, strict=True):
        w = w / w.norm() if normalize else w
        torch.testing.assert_close(torch.tensor(g), w, rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def want(default_model) -> list[torch.Tensor]:
    return reference(default_model, [*PROMPTS, [1, 504, 3458, 282]])


@pytest.mark.parametrize(("page_size", "chunk"), [(16, 8192), (1, 7), (16, 5)])
def test_embeddings_are_transformers_last_hidden_state_however_the_prompt_runs(default_model, want, page_size,
                                                                               chunk):
    with LLM("default", page_size=page_size, max_num_batched_tokens=chunk) as llm:
        got = llm.embed([*PROMPTS, [1, 504, 3458, 282]])
        close(got, want)
        assert llm.embed(PROMPTS[1], normalize=False)[0] == pytest.approx(want[1].tolist(), rel=1e-4, abs=2e-5)
        # the second time the prompt is in the cache but for its last token: the same vector
        again = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0, embed=True))[0]
        assert again.cached_tokens > 0 and again.token_ids == [] and again.completion_tokens == 0
        assert again.embedding == pytest.approx(want[1].tolist(), rel=1e-4, abs=2e-5)
        s = llm.wait_idle()
        assert s.running == 0 and s.pages_used == s.pages_cached


def test_generation_batched_with_embeddings_is_unchanged(default_model, want):
    with LLM("default", max_num_batched_tokens=16) as llm:
        plain = llm.generate(PROMPTS, GREEDY)
        embed = SamplingParams(max_tokens=1, temperature=0, embed=True)
        mixed = llm.generate([*PROMPTS, *PROMPTS], [GREEDY] * 3 + [embed] * 3)
        assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in plain]
        assert all(o.embedding is None for o in mixed[:3])
        close([o.embedding for o in mixed[3:]], want[:3], normalize=False)
        assert all(o.finish_reason == "stop" and o.text == "" for o in mixed[3:])


def test_an_embedding_request_runs_its_prompt_alone():
    for params in (SamplingParams(max_tokens=2, embed=True), SamplingParams(max_tokens=1, embed=True, n=2),
                   SamplingParams(max_tokens=1, fill_context=True, embed=True)):
        with pytest.raises(RequestError, match="embedding request"):
            params.validate()


def st_files(folder: Path, pooling: dict | None, modules: list[str]) -> Path:
    """sentence-transformers' modules.json (and the Pooling module's config) in folder."""
    entries = [{"idx": i, "name": str(i), "path": f"{i}_{m}" if m != "Transformer" else "", "type":
                f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (folder / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


LAST = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}


def test_the_folders_sentence_transformers_files_say_how_to_pool(tmp_path):
    assert pooling_config(tmp_path) == Pooling(normalize=True)  # (none: last token, normalized)
    assert pooling_config(st_files(tmp_path, LAST, ["Transformer", "Pooling", "Normalize"])) == Pooling(True)
    assert pooling_config(st_files(tmp_path, LAST, ["Transformer", "Pooling"])) == Pooling(False)
    mean = pooling_config(st_files(tmp_path, {**LAST, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True},
                                   ["Transformer", "Pooling", "Normalize"]))
    assert mean.unsupported is not None and "mean_tokens" in mean.unsupported
    dense = pooling_config(st_files(tmp_path, LAST, ["Transformer", "Pooling", "Dense", "Normalize"]))
    assert dense.unsupported is not None and "Dense" in dense.unsupported
    (tmp_path / "modules.json").write_text("not json")
    assert pooling_config(tmp_path) == Pooling()


def test_a_qwen3_embedding_style_model_pools_as_its_folder_says(tmp_path, default_model):
    """Qwen3-Embedding's layout: a Qwen3 decoder, last-token pooling, no Normalize module here
    (so the raw hidden state), and a mean-pooling folder refused by name."""
    folder = make_tiny_model(tmp_path / "qwen3", "Qwen3ForCausalLM", default_model)
    st_files(folder, LAST, ["Transformer", "Pooling"])
    want = reference(folder, PROMPTS)
    with LLM(str(folder)) as llm:
        assert llm.engine.info.pooling == Pooling(normalize=False)
        close(llm.embed(PROMPTS), want, normalize=False)
        close(llm.embed(PROMPTS, normalize=True), want)
    st_files(folder, {**LAST, "pooling_mode_lasttoken": False, "pooling_mode_cls_token": True}, ["Transformer",
                                                                                                   "Pooling"])
    with LLM(str(folder)) as llm, pytest.raises(RequestError, match="cls_token"):
        llm.embed(PROMPTS)
