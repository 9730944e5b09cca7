"""On the GPU (bf16, CUDA graphs, the decode GEMV): greedy output with ngram speculation is plain
greedy output token for token at batch 1, ties and near-ties included, because each verify
step runs as decode rows that compute as a lone decode row does (runner.row_graphs: the GEMVs
with M = 1's config row by row, attention split as at batch 1). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from streamer import LLM, SamplingParams
from tests.gpu.test_gpu_correctness import tiny_models  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PARAMS = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Prompts that repeat a segment (proposals found and accepted), and a plain random one."""
    g = torch.Generator().manual_seed(2)
    out = []
    for n, times in ((40, 3), (12, 6), (200, 1)):
        seg = torch.randint(10, 40000, (n,), generator=g).tolist()
        out.append(seg * times)
    return out


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_bf16_greedy_with_ngram_speculation_is_plain_greedy_at_batch_1(tiny_models, family):  # noqa: F811
    path = str(tiny_models[family])
    batch = prompts()
    with LLM(path, dtype="bfloat16") as llm:
        plain = [llm.generate([p], PARAMS)[0].token_ids for p in batch]
    with LLM(path, dtype="bfloat16", speculative_config=SPEC) as llm:
        assert llm.engine.runner.row_graphs is not None, "verify steps at batch 1 run as decode rows"
        got = [llm.generate([p], PARAMS)[0].token_ids for p in batch]
        s = llm.stats()
    assert s.spec_accepted_tokens > 0
    for i, (a, b) in enumerate(zip(got, plain)):
        assert a == b, (family, i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
