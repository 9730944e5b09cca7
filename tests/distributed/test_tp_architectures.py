"""Tensor parallelism over 2 ranks of tiny random Gemma 2, Gemma 3 and Phi-3 models on gloo:
the answers of one rank (greedy tokens, prompt logprobs within 1e-4) on the workload of
tests/distributed/workload.py (a cached prefix, chunked prefill, preemption). Gemma's
extra norms, scaled embedding, capped scores and logits and sliding windows, and Phi-3's
fused checkpoint tensors (read by each rank as the slices of their q, k, v and gate, up
parts) are what these add to the Llama family's tests."""

from __future__ import annotations

import pytest

from streamer import LLM
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, run
from tests.model.test_architectures import ARCHS


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_two_ranks_answer_as_one(tmp_path, default_model, name):
    arch, kw = ARCHS[name]
    path = make_tiny_model(tmp_path / name, arch, default_model, **kw)
    with LLM(str(path), **ENGINE) as llm:
        one = run(llm)
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        two = run(llm)
        s = llm.wait_idle()
        llm.check()
    assert_same(two, one)
    assert s.running == 0 and s.pages_used == s.pages_cached
