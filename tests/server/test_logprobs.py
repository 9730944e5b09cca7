"""Logprobs as OpenAI reports them: echo of the prompt (its text, its tokens' logprobs), and
each token's own bytes, also where a token is part of a UTF-8 character."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ---- echo ----------------------------------------------------------------------------


def test_echo_prepends_the_prompt_to_the_completion(client):
    plain = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)


def test_echo_with_logprobs_gives_the_prompt_tokens_first_without_a_logprob(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=0)
    c, u = r.choices[0], r.usage
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == u.prompt_tokens + u.completion_tokens
    assert "".join(lp.tokens) == c.text and "".join(lp.tokens[: u.prompt_tokens]) == PROMPT
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]


def test_an_echoed_token_has_the_logprob_the_model_gave_it(client):
    """Greedy: the token generated after the prompt, echoed in prompt + token, gets the same
    logprob from the prompt's forward as it had when sampled."""
    first = client.completions.create(model="smol", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    token, generated = first.choices[0].logprobs.tokens[0], first.choices[0].logprobs.token_logprobs[0]
    again = client.completions.create(model="smol", prompt=PROMPT + token, max_tokens=0, echo=True, logprobs=0)
    lp = again.choices[0].logprobs
    assert lp.tokens[-1] == token and lp.token_logprobs[-1] == pytest.approx(generated, abs=1e-3)


def test_echo_with_top_logprobs_scores_a_continuation_as_evaluation_harnesses_do(client):
    """lm-eval's loglikelihood: echo, max_tokens 0, logprobs 1; the continuation is greedy
    when each of its tokens is the top one at its position."""
    first = client.completions.create(model="smol", prompt=PROMPT, max_tokens=2, temperature=0)
    greedy = first.choices[0].text
    r = client.completions.create(model="smol", prompt=PROMPT + greedy, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None and all(len(t) <= 3 for t in lp.top_logprobs[1:])
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert max(top.values()) >= logprob - 1e-4
        if token in top:
            assert top[token] == pytest.approx(logprob, abs=1e-4)
    tail = list(zip(lp.tokens, lp.top_logprobs))[-2:]  # the greedy continuation's two tokens
    assert all(max(top, key=top.get) == token for token, top in tail)


def test_a_completion_s_top_logprobs_hold_the_chosen_token_too(client):
    """The legacy API returns "up to logprobs + 1 elements": the top k and the sampled token's
    own, whether or not it is among them (as for an echoed prompt's tokens)."""
    hot = client.completions.create(model="smol", prompt=PROMPT, max_tokens=24, temperature=2.0, seed=3,
                                    logprobs=1).choices[0].logprobs
    for token, lp, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(lp)
    assert any(len(top) == 2 for top in hot.top_logprobs)  # sampled tokens outside the top 1 (seeded)
    echo = client.completions.create(model="smol", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1).choices[0]
    for token, lp, top in zip(echo.logprobs.tokens[1:], echo.logprobs.token_logprobs[1:],
                              echo.logprobs.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(lp, abs=1e-6)


def test_echo_with_max_tokens_0_is_the_prompt_alone(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0
    lp = client.completions.create(model="smol", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0).choices[0].logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens and "".join(lp.tokens) == PROMPT


def test_echo_of_token_ids_is_their_text(client, http):
    ids = http.post("/tokenize", json={"text": PROMPT}).json()["input_ids"]
    r = client.completions.create(model="smol", prompt=[ids, ids], max_tokens=0, echo=True, n=2)
    assert [c.text for c in r.choices] == [PROMPT] * 4


def test_echo_streams_the_prompt_as_each_choice_s_first_chunk(http):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0, "n": 2}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = events(r)
    firsts = [c["choices"][0] for c in chunks[:2]]
    assert [f["index"] for f in firsts] == [0, 1] and all(f["text"] == PROMPT for f in firsts)
    assert all(f["logprobs"]["token_logprobs"][0] is None for f in firsts)
    whole = http.post("/v1/completions", json=body).json()["choices"]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == whole[i]["text"]
        tokens = [t for m in mine if m["logprobs"] for t in m["logprobs"]["tokens"]]
        offsets = [o for m in mine if m["logprobs"] for o in m["logprobs"]["text_offset"]]
        assert tokens == whole[i]["logprobs"]["tokens"] and offsets == whole[i]["logprobs"]["text_offset"]


def test_a_streamed_echo_of_max_tokens_0_is_the_prompt_then_its_end(http):
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = events(r)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == \
        [(PROMPT, None), ("", "length")]


# ---- bytes ---------------------------------------------------------------------------

EMOJI_PART = 235
"""A token of SmolLM2's vocabulary that is the second byte of 👋 (0x91) alone: "👋" is
tokenized " \\xf0\\x9f" (15107), "\\x91" (235), "\\x8b" (229)."""


def test_logprob_bytes_are_the_token_s_own_bytes(client):
    forced = {str(EMOJI_PART): 100}  # (the bias makes the model say it)
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Wave!"}], max_tokens=1,
                                       temperature=0, logprobs=True, top_logprobs=3, logit_bias=forced)
    (t,) = r.choices[0].logprobs.content
    assert t.bytes == [0x91]  # the token's byte, not the UTF-8 of the "\ufffd" it decodes to alone
    assert t.token == "\ufffd"
    top = {x.token: x for x in t.top_logprobs}
    assert top["\ufffd"].bytes == [0x91]
    assert all(x.bytes is not None for x in t.top_logprobs)


def test_the_bytes_of_a_reply_s_tokens_are_its_utf8(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say café in French."}],
                                       max_tokens=12, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content


# ---- prompt_logprobs (vLLM's extension) ----------------------------------------------


def test_prompt_logprobs_give_each_prompt_token_its_logprob_rank_and_the_top_ones(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=0,
                                  extra_body={"prompt_logprobs": 2})
    c, u = r.choices[0], r.usage
    prompt = c.model_extra["prompt_logprobs"]
    assert len(prompt) == u.prompt_tokens and prompt[0] is None  # nothing predicts the first token
    echoed = c.logprobs.token_logprobs[: u.prompt_tokens]  # the same logprobs, as echo reports them
    for k, entry in enumerate(prompt[1:], start=1):
        first_id, first = next(iter(entry.items()))  # the prompt's own token comes first
        assert first["logprob"] == pytest.approx(echoed[k], abs=1e-5)
        assert first["decoded_token"] == c.logprobs.tokens[k]
        tops = sorted((v["rank"], v["logprob"]) for i, v in entry.items() if i != first_id)
        assert len(entry) in (2, 3) and first["rank"] >= 1
        if len(entry) == 2:  # the token is one of the top 2: its rank is its place there
            assert first["rank"] <= 2
        else:
            assert [rank for rank, _ in tops] == [1, 2] and first["rank"] > 2
        assert all(lp >= first["logprob"] - 1e-6 for rank, lp in tops if rank < first["rank"])
    # echo's own top logprobs stay at what logprobs asked (0: the prompt token's own alone)
    tops = c.logprobs.top_logprobs[: u.prompt_tokens]
    assert tops[0] is None
    assert all(t == {token: pytest.approx(lp, abs=1e-6)}
               for t, token, lp in zip(tops[1:], c.logprobs.tokens[1:], echoed[1:]))


def test_prompt_logprobs_0_give_the_prompt_tokens_alone_and_chat_reports_them_for_the_rendered_prompt(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi there"}],
                                       max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    prompt = r.model_extra["prompt_logprobs"]
    assert len(prompt) == r.usage.prompt_tokens and prompt[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in prompt[1:])
    text = "".join(next(iter(entry.values()))["decoded_token"] for entry in prompt[1:])
    assert "Hi there" in text, "the template's rendering of the message"
    plain = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi there"}],
                                           max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_return_tokens_as_token_ids_names_each_token_by_its_id(client, default_model):
    """vLLM's return_tokens_as_token_ids: every token of the logprobs (echoed, sampled, top) is
    "token_id:{id}"; the text and its offsets are the text's, as without it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    kw = dict(model="smol", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    named = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in named.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in named.logprobs.tokens)
    assert [tok.decode([i]) for i in ids] == plain.logprobs.tokens and named.text == plain.text
    assert named.logprobs.text_offset == plain.logprobs.text_offset
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert all(all(k.startswith("token_id:") for k in t) for t in named.logprobs.top_logprobs[1:])
    chat = dict(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
                logprobs=True, top_logprobs=2)
    a = client.chat.completions.create(**chat).choices[0].logprobs.content
    b = client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content
    assert [tok.decode([int(t.token.removeprefix("token_id:"))]) for t in b] == [t.token for t in a]
    assert [t.bytes for t in b] == [t.bytes for t in a]
    assert all(x.token.startswith("token_id:") for t in b for x in t.top_logprobs)
