"""What tensor parallelism refuses before any rank starts, each with a message naming
tensor_parallel_size (no process is started: these are fast)."""

from __future__ import annotations

import pytest

from streamer import LLM
from streamer.config import EngineConfig
from streamer.errors import ConfigError
from tests.conftest import make_tiny_model


def test_heads_that_do_not_divide_are_refused(default_model):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 must divide the number of attention heads \(9\)"):
        LLM(str(default_model), tensor_parallel_size=2)


def test_an_expert_size_that_does_not_divide_is_refused(tmp_path, default_model):
    """(Quantized checkpoints run split: tests/distributed/test_tp_quantized.py.)"""
    moe = make_tiny_model(tmp_path / "qwen3-moe", "Qwen3MoeForCausalLM", None, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=30)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 must divide the MLP's moe_intermediate_size \(30\)"):
        LLM(str(moe), tensor_parallel_size=4)


def test_nodes_need_a_rendezvous_and_an_even_split(default_model, monkeypatch):
    with pytest.raises(ConfigError, match="must be a multiple of nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ConfigError, match="node_rank"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="set MASTER_ADDR and MASTER_PORT"):
        LLM(str(default_model), tensor_parallel_size=3, nnodes=3)
