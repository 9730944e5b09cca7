"""Tensor parallelism over 2 ranks of a tiny random Qwen3 (q/k/v and o biases, per-head q/k
norms, 1 KV head replicated on both ranks, a vocabulary of 49,153 rows: an uneven split),
started as two nodes on this host: node 1 is `streamer serve --nnodes 2 --node-rank 1`,
meeting node 0 at MASTER_ADDR:MASTER_PORT. One engine serves every test here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from streamer import LLM
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, collectives_of_one_step, run


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, default_model):
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "qwen3", "Qwen3ForCausalLM", default_model,
                           num_key_value_heads=1, attention_bias=True, vocab_size=49153)


@pytest.fixture(scope="module")
def one_rank(qwen3):
    with LLM(str(qwen3), **ENGINE) as llm:
        yield run(llm)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(qwen3):
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    node1 = subprocess.Popen([sys.executable, "-m", "streamer", "serve", "--model", str(qwen3), "--device", "cpu",
                              "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--num-pages", str(ENGINE["num_pages"])])
    try:
        llm = LLM(str(qwen3), tensor_parallel_size=2, nnodes=2, **ENGINE)
        yield llm, node1
        llm.close()
        assert node1.wait(timeout=30) == 0, "node 1's rank left in order when the engine stopped"
    finally:
        if node1.poll() is None:
            node1.kill()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_two_ranks_on_two_nodes_answer_as_one(two_nodes, one_rank):
    llm, _ = two_nodes
    assert_same(run(llm), one_rank)


def test_collectives_of_a_step(two_nodes):
    llm, _ = two_nodes
    assert collectives_of_one_step(llm) == {"step": 1, "all_reduce": 5, "all_gather": 1, "broadcast": 1}
    assert llm.engine.runner.pool.k.shape[3] == 1 and llm.engine.runner.model.lm_head.weight.shape[0] == 24577
