"""Sampling through the engine on the default model: seeds, n > 1 by seed + i, logprobs."""

from __future__ import annotations

import pytest
import torch

from streamer.messages import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "My favourite colour is",
]


def ids(llm, text: str) -> list[int]:
    return llm.tokenizer(text, add_special_tokens=True)["input_ids"]


def test_seed_reproduces_alone_and_in_a_mixed_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=20)
    alone = llm.generate([PROMPTS[1]], [seeded])[0]
    assert alone.finish_reason in ("length", "stop") and alone.token_ids
    others = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25),
        SamplingParams(temperature=1.2, seed=7, top_k=40, presence_penalty=0.5, max_tokens=8),
    ]
    batch = llm.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]], [others[0], seeded, others[1], others[2]]
    )
    assert batch[1].token_ids == alone.token_ids
    # and again, first in a different batch order
    batch = llm.generate([PROMPTS[1], PROMPTS[3], PROMPTS[2]], [seeded, others[2], others[1]])
    assert batch[0].token_ids == alone.token_ids


def test_n_by_seed_plus_i_gives_distinct_completions(llm):
    s = 1000
    params = [SamplingParams(temperature=1.0, seed=s + i, max_tokens=16) for i in range(3)]
    outs = llm.generate([PROMPTS[1]] * 3, params)
    texts = [o.text for o in outs]
    assert len(set(texts)) == 3, texts
    assert [o.text for o in llm.generate([PROMPTS[1]] * 3, params)] == texts


def test_greedy_logprobs_equal_transformers(llm, model_dir):
    from transformers import AutoModelForCausalLM

    prompt = ids(llm, PROMPTS[0])
    out = llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)])[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        seq = torch.tensor([prompt + out.token_ids[:-1]])
        logits = hf(seq).logits[0, len(prompt) - 1 :].float()
    ref = torch.log_softmax(logits, dim=-1)
    for k, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok == int(ref[k].argmax()), k
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[k, tok].item(), abs=2e-3)
        top_v, top_i = ref[k].topk(5)
        assert [i for i, _ in lp.top_logprobs] == top_i.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top_v.tolist(), abs=2e-3)


def test_min_tokens_and_ignore_eos(llm):
    eos = llm.engine.eos_token_ids
    outs = llm.generate(
        ["Say hi."] * 2,
        [
            SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        ],
    )
    for o in outs:
        assert len(o.token_ids) == 12 and o.finish_reason == "length"
    assert not set(outs[0].token_ids) & set(eos)
