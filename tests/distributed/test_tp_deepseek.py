"""Tensor parallelism over 2 ranks of tiny random DeepSeek-V2 and V3 models on gloo: the
answers of one rank (greedy tokens, prompt logprobs within 1e-4) on the workload of
tests/distributed/workload.py (a cached prefix, chunked prefill, preemption), and greedy
output as transformers'. The models are tests/model/test_deepseek.py's (V2 with q_proj and
group-limited softmax routing; V3 with q_lora_rank, attention biases, YaRN, a dense first
layer and noaux_tc routing): each rank holds 2 of the 4 heads (q_proj / q_b_proj,
kv_b_proj, o_proj split by heads), the whole latent projections and cache, and half of every
expert's, the shared experts' and the dense MLP's intermediate size."""

from __future__ import annotations

import pytest

from streamer import LLM, SamplingParams
from streamer.errors import ConfigError
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, run
from tests.model.test_deepseek import CONFIGS, perturb
from tests.model.test_greedy_vs_transformers import assert_matches, prompts, run_and_compare

TP_ENGINE = dict(ENGINE, max_model_len=256)
"""The workload's prompts and answers run past the tiny models' 128 positions (the rotary
tables are built for max_model_len; both engines use the same)."""


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_two_ranks_answer_as_one_and_as_transformers(tmp_path, default_model, arch):
    path = make_tiny_model(tmp_path / arch, arch, default_model, **CONFIGS[arch])
    perturb(path)
    with LLM(str(path), **TP_ENGINE) as llm:
        one = run(llm)
    with LLM(str(path), tensor_parallel_size=2, **TP_ENGINE) as llm:
        two = run(llm)
        attn = llm.engine.runner.model.layers[1].self_attn
        assert attn.heads == 2 and attn.kv_b_proj.weight.shape[0] == 2 * (16 + 12)  # (rank 0's heads)
        assert tuple(llm.engine.runner.pool.k.shape[-2:]) == (1, 32 + 8)  # the whole latent
        batch = prompts(llm.tokenizer, 2, 10, 60, seed=1)
        assert_matches(run_and_compare(llm, path, batch, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True)), 2)
    assert_same(two, one)


def test_heads_that_do_not_divide_are_refused(tmp_path, default_model):
    """(Refused before any rank starts. Float8 checkpoints run split: tests/distributed/test_tp_quantized.py.)"""
    arch = "DeepseekV2ForCausalLM"
    three = make_tiny_model(tmp_path / "three", arch, default_model,
                            **dict(CONFIGS[arch], hidden_size=48, num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 must divide the number of attention heads \(3\)"):
        LLM(str(three), tensor_parallel_size=2)
