"""Tensor parallelism over 3 ranks of a model with the default model's head layout (9 heads, 3 KV
heads: one KV head per rank; tiny random weights, its tokenizer) on gloo: the answers of one rank,
one all-reduce per row-parallel layer and the embedding, one step message per step; a rank
killed mid-run ends the engine, and no rank process outlives it. One engine of 3 ranks serves
every test here (the last kills it). (The default model itself in 3 ranks took ~60 s on CI's
2 cores; the layout, not the weights, is what 3 ranks split.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from streamer import LLM, SamplingParams
from streamer.messages import GenerateRequest
from streamer.model.tp_group import COUNTS
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, collectives_of_one_step, run


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model):
    """SmolLM2-135M's attention layout (9 heads over 3 KV heads) at a tiny width."""
    return make_tiny_model(tmp_path_factory.mktemp("tp3") / "llama", "LlamaForCausalLM", default_model,
                           hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                           intermediate_size=192, num_hidden_layers=3)


@pytest.fixture(scope="module")
def one_rank(model):
    with LLM(str(model), **ENGINE) as llm:
        yield run(llm)


@pytest.fixture(scope="module")
def tp3(model):
    llm = LLM(str(model), tensor_parallel_size=3, **ENGINE)
    yield llm
    llm.close()


def test_three_ranks_answer_as_one(tp3, one_rank):
    assert_same(run(tp3), one_rank)
    s = tp3.wait_idle()
    tp3.check()
    assert s.running == 0 and s.pages_used == s.pages_cached


def test_one_all_reduce_per_row_parallel_layer_and_one_message_per_step(tp3):
    layers = tp3.engine.runner.hf_config.num_hidden_layers
    # o_proj and down_proj of each layer, the embedding; the logits' gather; the tokens
    assert collectives_of_one_step(tp3) == {"step": 1, "all_reduce": 2 * layers + 1, "all_gather": 1, "broadcast": 1}
    pool = tp3.engine.runner.pool
    assert pool.k.shape[3] == 1, "each rank holds one of the 3 KV heads"


def test_a_killed_rank_ends_the_engine_and_no_process_is_left(tp3):
    workers = list(tp3.engine.runner.workers.procs.values())
    request = GenerateRequest(request_id="long", prompt_token_ids=[5, 6, 7],
                              params=SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    steps = COUNTS["step"]
    pending = asyncio.run_coroutine_threadsafe(tp3.engine.generate(request), tp3.loop)
    deadline = time.monotonic() + 60
    while COUNTS["step"] < steps + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(workers[1].pid, signal.SIGKILL)
    out = pending.result(timeout=60)
    assert out.finish_reason == "error" and "rank 2" in (out.error or "")
    deadline = time.monotonic() + 5  # (the engine is told through its event loop)
    while not tp3.engine.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tp3.engine.dead and "rank 2" in tp3.engine.dead
    t = time.monotonic()
    tp3.close()
    assert time.monotonic() - t < 15
    assert all(p.poll() is not None for p in workers), "every rank process has exited"
