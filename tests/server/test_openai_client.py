"""The official openai client against the live server: the API is OpenAI's, shapes included."""

from __future__ import annotations

import json

import openai
import pytest

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client):
    names = [m.id for m in client.models.list().data]
    assert names == ["smol"]


def test_completion(client):
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == "smol" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].text.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_of_token_ids_and_several_prompts(client):
    r = client.completions.create(model="smol", prompt=[[504, 3575, 282], [504, 3575]], max_tokens=4,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy copies agree
    assert r.usage.prompt_tokens == 3 + 2  # each prompt counted once, not once per copy
    assert 0 < r.usage.completion_tokens <= 4 * 4


def test_completion_stream(client):
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] or finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    full = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert full.choices[0].text == text  # streaming changes the transport, not the tokens


def test_chat(client):
    r = client.chat.completions.create(model="smol", messages=HELLO, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_without_model_and_with_max_completion_tokens(client):
    r = client.chat.completions.create(model=openai.omit, messages=HELLO, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_chat_stream_with_usage(client):
    client.chat.completions.create(model="smol", messages=HELLO, max_tokens=2)  # caches the prompt's pages
    stream = client.chat.completions.create(model="smol", messages=HELLO, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    # the same prompt again: its full pages come from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_n2_seeded(client):
    kw = dict(model="smol", messages=HELLO, max_tokens=8, temperature=1.0, seed=1234, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 0 < a.usage.completion_tokens <= 2 * 8


def test_chat_n2_stream(client):
    stream = client.chat.completions.create(model="smol", messages=HELLO, max_tokens=6, temperature=0, n=2,
                                            stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]


def test_stop_string(client):
    base = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text.strip().split()[1] if len(text.split()) > 1 else text[1:3]
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and text.startswith(r.choices[0].text)


def test_logprobs(client):
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    c = client.chat.completions.create(model="smol", messages=HELLO, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_response_format_json_object(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Give a JSON person."}],
                                       max_tokens=48, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_response_format_structural_tag(client):
    """xgrammar's format as it is (here the whole answer is one tag), and vLLM's structures and
    triggers (free text until a trigger; then the structure's schema holds up to its end)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    tag = {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": schema},
           "end": "</answer>"}
    ask = [{"role": "user", "content": "Name a city."}]
    r = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0,
                                       response_format={"type": "structural_tag", "format": tag})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert text.startswith("<answer>") and text.endswith("</answer>")
    assert set(json.loads(text[len("<answer>"):-len("</answer>")])) == {"city"}
    legacy = {"type": "structural_tag", "triggers": ["<answer>"],
              "structures": [{"begin": "<answer>", "schema": schema, "end": "</answer>"}]}
    for seed in range(3):  # (sampled: where the model writes the trigger, the schema holds after it)
        r = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, seed=seed, temperature=1.0,
                                           response_format=legacy)
        text = r.choices[0].message.content
        if "<answer>" in text and "</answer>" in text.split("<answer>", 1)[1]:
            inner = text.split("<answer>", 1)[1].split("</answer>", 1)[0]
            assert set(json.loads(inner)) == {"city"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=ask, max_tokens=4,
                                       response_format={"type": "structural_tag", "triggers": ["<a>"]})
    assert e.value.body["param"] == "response_format"


def test_guided_choice(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Yes or no?"}],
                                       max_tokens=8, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")


def test_sampling_extensions_are_accepted(client):
    r = client.completions.create(
        model="smol", prompt="Count: 1 2 3", max_tokens=6, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"28": -100}, seed=7, user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 6  # ignore_eos: always runs to max_tokens


def test_bad_request_raises_openai_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=HELLO, max_tokens=4, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


def test_an_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=HELLO, max_tokens=4)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert e.value.body["message"] == "The model `nope` does not exist."
