"""The model folder's generation_config.json -> the sampling defaults of requests that omit them."""

from __future__ import annotations

import json

from streamer.engine.generation_config import generation_defaults, sampling_defaults

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def test_the_five_sampling_fields_are_read_and_nothing_else():
    assert sampling_defaults(QWEN3) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    full = {"temperature": 0.7, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.05, "min_p": 0.05,
            "do_sample": False, "max_new_tokens": 2048, "num_beams": 1}
    assert sampling_defaults(full) == {"temperature": 0.7, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.05,
                                       "min_p": 0.05}


def test_none_gives_no_default():
    assert sampling_defaults({}) == {}
    assert sampling_defaults({"temperature": None, "top_p": None}) == {}


def test_top_k_0_is_transformers_off_which_is_minus_1_here():
    assert sampling_defaults({"top_k": 0}) == {"top_k": -1}
    assert sampling_defaults({"top_k": 50.0})["top_k"] == 50


def test_a_value_a_request_could_not_give_is_left_out():
    bad = {"temperature": -1, "top_p": 0, "top_k": -5, "repetition_penalty": 0, "min_p": 1.5}
    assert sampling_defaults(bad) == {}
    assert sampling_defaults({"temperature": "0.7", "top_p": True, "top_k": 2.5, "min_p": float("nan")}) == {}
    assert sampling_defaults({"temperature": 0}) == {"temperature": 0}  # greedy is a valid default


def test_a_folder_without_a_readable_file_has_no_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_the_default_model_gives_none(default_model):
    assert generation_defaults(default_model) == {}  # (SmolLM2's file holds token ids only)
