"""Prompt logprobs (what `select` of the frontend language scores choices with)
equal log_softmax of transformers' logits, also when the prefix is cached."""

import torch

from streamer import LLM, SamplingParams
from tests.oracle import _hf_model


def test_prompt_logprobs_match_transformers_with_a_cached_prefix(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    prefix = tok("Question: what colour is the sky on a clear day? " * 4)["input_ids"]
    choices = [tok(" Answer: blue", add_special_tokens=False)["input_ids"],
               tok(" Answer: green", add_special_tokens=False)["input_ids"]]
    with LLM(str(default_model)) as llm:
        llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))  # cache the prefix
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=len(prefix))
        outs = llm.generate([prefix + c for c in choices], params)
    hf = _hf_model(str(default_model))
    for c, o in zip(choices, outs):
        assert o.cached_tokens >= 16, "the shared prefix came from the cache"
        ids = torch.tensor([prefix + c])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        want = [logp[len(prefix) + i - 1, t].item() for i, t in enumerate(c)]
        assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(c)
        assert torch.allclose(torch.tensor(o.prompt_logprobs), torch.tensor(want), atol=1e-4)
    assert sum(outs[0].prompt_logprobs) > sum(outs[1].prompt_logprobs), "blue is likelier than green"


def test_prompt_top_logprobs_are_transformers_top_tokens(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    ids = tok("The capital of France is Paris, and the capital of Italy is Rome.")["input_ids"]
    with LLM(str(default_model)) as llm:
        (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1,
                                                    prompt_top_logprobs=3))
        (plain,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=1))
    assert out.prompt_token_ids == ids and plain.prompt_top_logprobs is None
    tops = out.prompt_top_logprobs
    assert tops is not None and len(tops) == len(ids) - 1 == len(out.prompt_logprobs or [])
    with torch.no_grad():
        logp = torch.log_softmax(_hf_model(str(default_model))(torch.tensor([ids])).logits[0].float(), -1)
    for p, top in enumerate(tops):  # position p predicts token p + 1
        want_v, want_i = logp[p].topk(3)
        assert [t for t, _ in top] == want_i.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), want_v, atol=1e-4)
    # each prompt token's rank: 1 + the tokens more likely at its position (up to ties within 1e-4)
    ranks = out.prompt_ranks
    assert ranks is not None and len(ranks) == len(ids) - 1 and plain.prompt_ranks == ranks
    for p, rank in enumerate(ranks):
        lp = logp[p, ids[p + 1]]
        assert int((logp[p] > lp + 1e-4).sum()) + 1 <= rank <= int((logp[p] > lp - 1e-4).sum()) + 1
    assert any(rank > 3 for rank in ranks), "some token of the sentence is not among the top 3"
