"""bad_words (vLLM's): a word's tokenizations never end the output. Each is tokenized alone and
after a space; where the output so far ends with all but the last token of one, that last token
is banned (a one-token word: always). Greedy decoding with bad words is transformers' greedy
decoding with exactly those tokens' logits removed, step by step."""

import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.engine.request import Request
from tests.oracle import _hf_model

PROMPT = "Write a short story about a dog named Max who loves to play in the park."


def request_with(bad_words: list[list[int]]) -> Request:
    return Request("r", 1, [0], SamplingParams(), frozenset(), bad_words=bad_words)


def test_a_one_token_word_is_always_banned_and_a_longer_one_only_after_its_head():
    req = request_with([[7], [1, 2, 3], [9, 3]])
    assert req.bans([]) == [7]
    assert req.bans([5, 1, 2]) == [3, 7]
    assert req.bans([1, 2, 5]) == [7]
    assert req.bans([9]) == [3, 7]
    assert not request_with([[7]]).needs_last_tokens and req.needs_last_tokens
    req.tokens += [4, 4, 1, 2]  # (the prompt is one token: the output is what follows it)
    assert req.bans() == [3, 7] == req.bans(req.output)


@pytest.fixture(scope="module")
def llm(default_model):
    with LLM(str(default_model)) as engine:
        yield engine


@pytest.fixture(scope="module")
def overlapping(default_model):
    """An engine that builds the next batch while a step runs (not with a bad word of several tokens:
    its ban needs the token that step samples)."""
    with LLM(str(default_model), overlap_schedule=True) as engine:
        yield engine


def greedy_with_bans(default_model, prompt_ids: list[int], output: list[int], req: Request) -> None:
    """Each output token is transformers' argmax once the bans after the output before it are removed."""
    hf = _hf_model(str(default_model))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + output])).logits[0].float()
    for k, token in enumerate(output):
        row = logits[len(prompt_ids) + k - 1].clone()
        banned = req.bans(output[:k])
        row[banned] = float("-inf")
        top2 = row.topk(2).values
        assert token == int(row.argmax()) or float(top2[0] - top2[1]) < 1e-4, (k, token, banned)


@pytest.mark.parametrize("engine", ["llm", "overlapping"])
def test_greedy_output_never_writes_a_bad_word_and_is_transformers_greedy_without_it(engine, request, default_model):
    from transformers import AutoTokenizer

    llm = request.getfixturevalue(engine)
    tok = AutoTokenizer.from_pretrained(str(default_model))
    prompt_ids = tok(PROMPT)["input_ids"]
    params = dict(max_tokens=40, temperature=0, ignore_eos=True)
    (plain,) = llm.generate([prompt_ids], SamplingParams(**params))
    word, single = "the park", "loves"  # two tokens (" the", " park") and one
    assert f" {word}" in plain.text and f" {single}" in plain.text, plain.text
    assert len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 2
    for bad in ([word], [word, single]):
        (out,) = llm.generate([prompt_ids], SamplingParams(**params, bad_words=bad))
        assert all(f" {w}" not in out.text for w in bad) and out.text != plain.text
        if bad == [word]:  # the story still comes to " the" where it wrote " park": the ban after it held
            assert " the" in out.text, out.text
        seqs = llm.engine.tokenizer.encode_bad_words(SamplingParams(bad_words=bad))
        assert tok(" " + word, add_special_tokens=False)["input_ids"] in seqs
        greedy_with_bans(default_model, prompt_ids, list(out.token_ids), request_with(seqs))

def test_speculation_keeps_the_bans_of_each_verified_position(llm, default_model):
    """ngram speculation proposes the story's repeats; each verify row bans what the output and the
    proposals before it make a bad word's end, so the answer is the one without speculation."""
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(default_model))(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, bad_words=["the park", "loves"])
    (want,) = llm.generate([prompt_ids], params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with LLM(str(default_model), speculative_config=spec) as speculating:
        (got,) = speculating.generate([prompt_ids], params)
        stats = speculating.stats()
    assert stats.spec_verifies > 0 and got.token_ids == want.token_ids
