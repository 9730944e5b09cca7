"""On the GPU (bf16, CUDA graphs, the decode GEMV): greedy output with ngram speculation is plain
greedy output token for token at batch 1, ties and near-ties included, because each verify
step runs as decode rows that compute as a lone decode row does (runner.row_graphs: the GEMVs
with M = 1's config row by row, attention split as at batch 1). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.conftest import make_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# shapes where decode's one row has configs of its own and rows would round otherwise: q/k/v
# (5,120 rows) and the LM head (16,384) take M = 1's GEMV config, and an 8,192-token context
# splits a lone decode's attention 64 ways against 58 for a 9-row batch
SHAPES = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=32, head_dim=128,
              num_key_value_heads=4, vocab_size=16384, max_position_embeddings=8192, initializer_range=0.05)
ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PARAMS = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Prompts that repeat a segment (proposals found and accepted), and a plain random one."""
    g = torch.Generator().manual_seed(2)
    out = []
    for n, times in ((40, 3), (12, 6), (200, 1)):
        seg = torch.randint(10, 16000, (n,), generator=g).tolist()
        out.append(seg * times)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-gpu")
    return {f: make_tiny_model(root / f, arch, None, **SHAPES) for f, arch in ARCHS.items()}


@pytest.mark.parametrize("family", list(ARCHS))
def test_bf16_greedy_with_ngram_speculation_is_plain_greedy_at_batch_1(models, family):
    path = str(models[family])
    batch = prompts()
    with LLM(path, dtype="bfloat16") as llm:
        plain = [llm.generate([p], PARAMS)[0].token_ids for p in batch]
    with LLM(path, dtype="bfloat16", speculative_config=SPEC) as llm:
        rows = llm.engine.runner.row_graphs
        assert rows is not None, "verify steps at batch 1 run as decode rows"
        replays = []
        replay = rows.replay
        rows.replay = lambda x: (replays.append(x["input_ids"].shape[0]), replay(x))[1]
        try:
            got = [llm.generate([p], PARAMS)[0].token_ids for p in batch]
            s = llm.stats()
        finally:  # the wrapper and the graphs form a cycle; the graphs hold the KV pool
            del rows.replay
    assert s.spec_accepted_tokens > 0 and replays, (s.spec_accepted_tokens, len(replays))
    for i, (a, b) in enumerate(zip(got, plain)):
        assert a == b, (family, i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))


def test_eagle3_on_cuda_graphs_keeps_every_proposal_of_a_head_that_agrees(tmp_path):
    """bf16, CUDA graphs (the target's features come from the decode and extend graphs'
    static outputs; the head's steps replay its own decode graphs): a head that agrees with
    its target (eagle_heads.agreeing_pair) has every proposal kept; a random head beside it
    runs too, its pages all returned."""
    from tests.engine.spec.eagle_heads import agreeing_pair, make_head

    target, agree = agreeing_pair(tmp_path)
    params = SamplingParams(max_tokens=41, temperature=0, ignore_eos=True)
    with LLM(str(target), dtype="bfloat16",
             speculative_config={"method": "eagle3", "model": str(agree), "num_speculative_tokens": 4}) as llm:
        runner = llm.engine.runner
        assert runner.graphs is not None and runner.graphs.outputs and runner.draft.graphs is not None
        s0 = llm.stats()
        out = llm.generate([[5, 6, 7, 8, 9], list(range(100, 140))], params)
        s1 = llm.stats()
        llm.check()
    assert [o.token_ids for o in out] == [[0] * 41] * 2
    assert s1.spec_accepted_tokens - s0.spec_accepted_tokens == s1.spec_draft_tokens - s0.spec_draft_tokens > 0
    random_head = make_head(tmp_path / "random", target, draft_vocab=512, layer_ids=[0, 1, 2])
    with LLM(str(target), dtype="bfloat16",
             speculative_config={"method": "eagle3", "model": str(random_head), "num_speculative_tokens": 3}) as llm:
        out = llm.generate([[5, 6, 7, 8, 9], list(range(100, 140))], params)
        s = llm.stats()
        llm.check()
    assert [len(o.token_ids) for o in out] == [41, 41] and s.spec_verifies > 0


def test_bf16_lora_requests_with_ngram_speculation_follow_them_without(models, tmp_path):
    """A LoRA request's verify steps (eager: the graphs hold the base model alone) run with its
    adapter: its greedy output follows the adapter's without speculation, up to a near-tie."""
    from tests.distributed.workload import assert_follows_until_near_tie
    from tests.model.lora_files import make_adapter

    path = models["qwen3"]
    adapter = make_adapter(tmp_path / "one", path, ["q_proj", "v_proj", "down_proj"], rank=8, alpha=16, seed=1,
                           std=0.05)
    batch = prompts()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=5, lora="one")
    kw = {"dtype": "bfloat16", "lora_modules": (f"one={adapter}",)}
    with LLM(str(path), **kw) as llm:
        plain = [llm.generate([p], params)[0] for p in batch]
    with LLM(str(path), speculative_config=SPEC, **kw) as llm:
        got = [llm.generate([p], params)[0] for p in batch]
        s = llm.stats()
    assert s.spec_accepted_tokens > 0
    assert_follows_until_near_tie(got, plain)
