"""speculative_config: parsed and validated; what is not implemented is refused by name."""

from __future__ import annotations

import pytest

from streamer.cli import build_parser, engine_config
from streamer.config import EngineConfig
from streamer.engine.spec.ngram import from_prediction, propose
from streamer.errors import ConfigError
from streamer.speculative_config import SpeculativeConfig, parse_speculative_config


def test_a_dict_and_json_text_parse_to_the_same_config():
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=5)
    d = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert parse_speculative_config(d) == want
    assert parse_speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}') == want
    assert EngineConfig(speculative_config=d).speculative_config == want
    assert EngineConfig(speculative_config=want).speculative_config == want  # (LLM passes it on parsed)
    assert EngineConfig().speculative_config is None


def test_the_cli_flag_reaches_the_engine_config():
    for cmd in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*cmd, "--speculative-config", '{"num_speculative_tokens": 2}'])
        assert engine_config(args).speculative_config == SpeculativeConfig(num_speculative_tokens=2)


@pytest.mark.parametrize(
    "value, words",
    [
        ({"method": "lookahead"}, "method must be one of ngram, draft_model, eagle3, eagle, not 'lookahead'"),
        ({"method": "medusa"}, "method 'medusa': Medusa heads are not supported"),
        ({"method": "eagle3"}, "'eagle3' needs 'model': the EAGLE head's folder"),
        ({"method": "eagle"}, "'eagle' needs 'model': the EAGLE head's folder"),
        ({"method": "eagle3", "model": "x", "prompt_lookup_min": 1},
         "unknown speculative_config key(s) for method 'eagle3': prompt_lookup_min"),
        ({"method": "draft_model"}, "'draft_model' needs 'model'"),
        ({"method": "draft_model", "model": "x", "prompt_lookup_max": 3},
         "unknown speculative_config key(s) for method 'draft_model': prompt_lookup_max"),
        ({"num_speculative_tokens": 4, "lookahead": 2}, "unknown speculative_config key(s) for method 'ngram': lookahead"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 64]"),
        ({"num_speculative_tokens": "4"}, "Expected `int`"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be at least 1, not 0"),
        ({"exact_verify": True, "num_speculative_tokens": 16}, "exact_verify takes at most 15 num_speculative_tokens"),
        ({"exact_verify": "yes"}, "Expected `bool | null`"),
        ({"method": "draft_model", "model": "x", "exact_verify": True},
         "unknown speculative_config key(s) for method 'draft_model': exact_verify"),
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_by_name(value, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=value)
    assert words in str(e.value)


def test_exact_verify_is_auto_unless_given():
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config.exact_verify is None
    off = EngineConfig(speculative_config={"method": "ngram", "exact_verify": False, "num_speculative_tokens": 32})
    assert off.speculative_config.exact_verify is False


def test_a_request_whose_proposals_keep_failing_is_scheduled_ahead_for_longer_and_longer():
    from streamer.engine.spec.rollback import ahead_budget

    assert [ahead_budget(m) for m in range(8)] == [0, 1, 2, 4, 8, 16, 16, 16]


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the suffix [1, 2, 3] occurred at 6 (latest, followed by 7 8) and at 0
    assert propose(seq, 3, 1, 3) == [7, 8, 1]
    assert propose(seq, 1, 1, 3) == [7]
    # a longer suffix wins over a later short match: [9, 1, 2] x -> the 4-gram [5, 9, 1, 2]...
    seq2 = [5, 9, 1, 2, 6, 6, 2, 0, 5, 9, 1, 2]
    assert propose(seq2, 2, 1, 4) == [6, 6]
    assert propose(seq2, 2, 1, 1) == [0, 5]  # (only [2]: its latest earlier occurrence is at 6)
    assert propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose([4, 4], 3, 2, 3) == []  # shorter than prompt_lookup_min + 1
    assert propose([4, 4, 4], 5, 1, 2) == [4]  # (the match at 0 is followed by one token only)


def test_a_prediction_proposes_what_follows_the_output_in_it_moving_forward():
    pred = [10, 11, 12, 13, 10, 11, 14, 15]
    # the output's last token 10 occurs at 0 and at 4: the first ending at or after the alignment
    assert from_prediction([10], pred, 0, 3, 4) == ([11, 12, 13], 1)
    assert from_prediction([10, 11, 12, 13, 10], pred, 4, 3, 4) == ([11, 14, 15], 5)
    # a longer suffix decides where a short one would not: [13, 10, 11] occurs only at 3
    assert from_prediction([9, 13, 10, 11], pred, 0, 2, 4) == ([14, 15], 6)
    # past the last occurrence the last one is taken; at the prediction's end, nothing
    assert from_prediction([11], pred, 7, 2, 4) == ([14, 15], 6)
    assert from_prediction([15], pred, 0, 2, 4) == ([], 8)
    # the output strayed (a token the prediction lacks), then came back to it
    assert from_prediction([10, 99], pred, 1, 2, 4) == ([], 1)
    assert from_prediction([10, 99, 13], pred, 1, 2, 4) == ([10, 11], 4)
    assert from_prediction([10], [], 0, 2, 4) == ([], 0) and from_prediction([10], pred, 0, 0, 4) == ([], 0)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_draft_model_runs_with_a_host_tier_and_tensor_parallelism(method):
    """(The host tier moves the draft's pages: tests/engine/spec/test_host_tier.py; under tensor
    parallelism rank 0 alone drafts: tests/distributed.)"""
    draft = {"method": method, "model": "default"}
    assert EngineConfig(speculative_config=draft).speculative_config.model == "default"
    assert EngineConfig(speculative_config=draft, host_kv_cache_gb=1).host_kv_cache_gb == 1
    assert EngineConfig(speculative_config=draft, tensor_parallel_size=2).speculative_config.method == method


def test_the_config_the_other_ranks_receive_parses_back():
    import msgspec

    for d in ({"method": "draft_model", "model": "m"}, {"method": "eagle3", "model": "h", "num_speculative_tokens": 2},
              {"prompt_lookup_max": 3}, {"method": "ngram", "exact_verify": False}):
        cfg = EngineConfig(speculative_config=d, tensor_parallel_size=2)
        sent = msgspec.convert(msgspec.to_builtins(cfg), EngineConfig)
        assert sent.speculative_config == cfg.speculative_config


def why_not(llm) -> str | None:
    from streamer.model.exact_verify import unavailable

    runner = llm.engine.runner
    return unavailable(runner.config, runner.hf_config, runner.model)


def test_where_exact_verify_cannot_apply_the_runner_says_why(tmp_path, default_model):
    """The conditions of the decode-row verify (checked on CUDA at start: refused when
    exact_verify is true, skipped when it is left to the engine), read here on CPU."""
    from streamer import LLM
    from streamer.model.exact_verify import unavailable
    from tests.conftest import make_tiny_model
    from tests.model.test_moe import ARCHS as MOE

    spec = {"method": "ngram", "num_speculative_tokens": 15}
    with LLM(str(default_model), speculative_config=spec, dtype="bfloat16") as llm:
        assert why_not(llm) is None
        runner = llm.engine.runner
        runner.model.layers[0].mlp.gate_up_proj.block = (128, 128)  # as a block-scaled checkpoint's layer
        assert "block-scaled float8" in unavailable(runner.config, runner.hf_config, runner.model)
    with LLM(str(default_model), speculative_config=spec) as llm:  # float32 on the CPU
        assert "float32 model runs cuBLAS at one row" in why_not(llm)
    with LLM(str(default_model), speculative_config=spec, decode_gemv=False) as llm:
        assert "decode_gemv is off" in why_not(llm)
    for name in ("qwen3_moe", "glm4_moe"):  # (configs naming the count num_experts, n_routed_experts)
        arch, kw = MOE[name]
        moe = make_tiny_model(tmp_path / name, arch, default_model, **kw)
        with LLM(str(moe), speculative_config=spec, dtype="bfloat16") as llm:
            assert "mixture of experts" in why_not(llm)
