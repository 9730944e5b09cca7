"""RuntimeEndpoint runs programs against a live server through the native POST /generate."""

from __future__ import annotations

import json

import httpx
import pytest

from streamer.lang import ProgramError, RuntimeEndpoint, assistant, function, gen, select, user


@pytest.fixture(scope="module")
def remote(live_url):
    ep = RuntimeEndpoint(live_url)
    yield ep
    ep.close()


@function
def quiz(s):
    s += user("What is the capital of France? Answer in one word.")
    s += assistant(gen("answer", max_tokens=6))
    s += user("Is Paris in France? Say yes or no.")
    s += assistant(select("yn", ["yes", "no"]))
    forks = s.fork(2)
    forks += "Fun fact:" + gen("fact", max_tokens=4)
    forks.join("fact")


def test_a_program_runs_against_a_live_server(remote):
    st = quiz.run(backend=remote)
    assert st["yn"] in ("yes", "no") and st["answer"]
    assert len(st["fact"]) == 2
    assert st.messages()[1] == {"role": "assistant", "content": st["answer"]}
    assert st.text().endswith(f"<|im_start|>assistant\n{st['yn']}<|im_end|>\n")


def test_server_errors_surface_as_program_errors(remote):
    @function
    def bad(s):
        s += "x" + gen("x", max_tokens=2, regex="[")

    with pytest.raises(ProgramError, match="invalid regex"):
        bad.run(backend=remote)


def test_native_generate_json(live_url):
    body = {"text": "The capital of France is", "sampling_params": {"max_tokens": 4, "temperature": 0},
            "return_logprob": True, "prompt_logprobs_from": 2}
    r = httpx.post(f"{live_url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 4 and out["text"]
    assert meta["finish_reason"] == "length" and meta["prompt_tokens"] > 2
    assert len(meta["prompt_logprobs"]) == meta["prompt_tokens"] - 2
    assert [t for _, t in meta["output_logprobs"]] == out["output_ids"]

    batch = httpx.post(f"{live_url}/generate", timeout=60, json={
        "input_ids": [out["output_ids"], out["output_ids"][:2]], "sampling_params": {"max_tokens": 2}})
    assert batch.status_code == 200 and len(batch.json()) == 2

    bad = httpx.post(f"{live_url}/generate", json={"text": "x", "sampling_params": {"max_tokens": 0}}, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_native_generate_streams_sse(live_url):
    body = {"text": "Once upon a time", "sampling_params": {"max_tokens": 5, "temperature": 0}, "stream": True}
    events = []
    with httpx.stream("POST", f"{live_url}/generate", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["completion_tokens"] == 5
    full = httpx.post(f"{live_url}/generate", json={**body, "stream": False}, timeout=60).json()
    assert "".join(c["text"] for c in chunks) == full["text"]
