"""The host KV tier under tensor parallelism (2 gloo ranks): rank 0's scheduler decides the
copies between device and host pages; each step carries the copies made since the last
one, and every rank makes them on its own shard first. So 2 ranks answer the workload as
one rank with the same tier (greedy tokens, prompt logprobs within 1e-4), pages written
back and loaded back. (Before, only rank 0's shard moved: the other rank read stale pages.)"""

from __future__ import annotations

from streamer import LLM
from tests.conftest import make_tiny_model
from tests.distributed.workload import ENGINE, assert_same, run

TIER = dict(ENGINE, host_kv_cache_gb=0.01)


def test_two_ranks_with_a_host_tier_answer_as_one(tmp_path, default_model):
    path = str(make_tiny_model(tmp_path / "llama", "LlamaForCausalLM", default_model, num_hidden_layers=2))
    with LLM(path, **TIER) as llm:
        one = run(llm)
        one_host = llm.stats().host
    with LLM(path, tensor_parallel_size=2, **TIER) as llm:
        two = run(llm)
        host = llm.stats().host
        llm.check()
    assert host.write_backs > 0 and host.load_backs > 0, host
    assert (host.write_backs, host.load_backs) == (one_host.write_backs, one_host.load_backs)
    assert_same(two, one)
