"""Hostile grammars against a real server: none freezes it, none keeps running once refused.

Each case sends the hostile request in a thread and, while it is in flight, a bystander's
streamed completion, whose first token must come within 2 s, or within 5 times what it takes
on the idle server where that is longer (a slow machine is not a frozen server: before the
hardening, the bystander waited forever); /health must answer 200 all along. Afterwards the server's processes are idle again within seconds, their resident
memory is back within 200 MB of where it was, and no request or KV page is left behind.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import psutil
import pytest

from tests.reliability.conftest import ServerProcess

SERVER_ARGS = ["--grammar-compile-timeout", "3"]

BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
RECURSIVE_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.fixture(scope="module", autouse=True)
def _grammars_ready(server: ServerProcess) -> None:
    """One structured request first: the grammar process has started (serve starts it with
    the engine, in the background)."""
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Go:", "max_tokens": 2, "guided_regex": "[a-z]+"})
    assert r.status_code == 200, r.text


def first_token_s(url: str, body: dict[str, Any] | None = None) -> float:
    """Seconds from sending a streamed greedy completion to its first content chunk."""
    body = body or {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.monotonic() - t0
    raise AssertionError("no content chunk")


def cpu_busy(srv: ServerProcess, seconds: float = 0.5) -> float:
    """CPU seconds per second used by the server and all its processes over `seconds`."""
    procs = [psutil.Process(srv.pid), *psutil.Process(srv.pid).children(recursive=True)]

    def total() -> float:
        s = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                s += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return s

    a = total()
    time.sleep(seconds)
    return (total() - a) / seconds


def hostile(srv: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send body in a thread; meanwhile check /health and a bystander's first token."""
    result: dict[str, Any] = {}

    def send() -> None:
        t0 = time.monotonic()
        r = httpx.post(srv.url + path, json=body, timeout=60)
        result.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

    rss0 = srv.rss()
    idle = first_token_s(srv.url)
    bound = max(2.0, 5 * idle)
    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)  # (the hostile request is in the engine)
    assert httpx.get(srv.url + "/health", timeout=3).status_code == 200
    bystander = first_token_s(srv.url)
    grammar_bystander = first_token_s(srv.url, {"prompt": "Pick a digit:", "max_tokens": 2,
                                                "guided_regex": "[0-9]{2}"})
    t.join(60)
    assert not t.is_alive(), "the hostile request got no answer in 60 s"
    assert httpx.get(srv.url + "/health", timeout=3).status_code == 200
    result.update(bystander=bystander, grammar_bystander=grammar_bystander, idle=idle)
    print(f"\n{path}: {result['status']} in {result['seconds']:.2f} s; bystander's first token after "
          f"{bystander:.2f} s, with a grammar {grammar_bystander:.2f} s (idle: {idle:.2f} s)")
    assert bystander < bound and grammar_bystander < bound, result
    deadline = time.monotonic() + 10
    while (busy := cpu_busy(srv)) > 0.3:
        assert time.monotonic() < deadline, f"the server still uses {busy:.1f} cores 10 s after the answer"
    srv.wait_idle(timeout=10)
    assert srv.rss() - rss0 < 200 << 20, f"resident memory grew by {(srv.rss() - rss0) >> 20} MB"
    return result


@pytest.mark.parametrize("name, body", [
    ("ebnf", {"guided_grammar": 'root ::= "a" root'}),
    ("required $ref", {"guided_json": RECURSIVE_REQUIRED}),
])
def test_a_grammar_that_never_ends_finishes_with_length(server: ServerProcess, name: str, body: dict) -> None:
    """The forced text goes on forever: jump-forward takes a bounded piece of it per step and
    never more than max_tokens, so the request ends with "length" in seconds."""
    res = hostile(server, "/v1/completions", {"prompt": "Go:", "max_tokens": 200, "temperature": 0, **body})
    assert res["status"] == 200, res
    choice = res["body"]["choices"][0]
    assert choice["finish_reason"] == "length" and res["body"]["usage"]["completion_tokens"] == 200
    assert res["seconds"] < 10
    if name == "ebnf":
        assert set(choice["text"]) == {"a"}


def test_a_circular_ref_is_refused(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "Go:", "max_tokens": 8, "guided_json": {"$ref": "#"}})
    assert r.status_code == 400 and "Circular $ref" in r.json()["error"]["message"], r.text


def test_a_compilation_past_the_time_limit_is_refused_and_stopped(server: ServerProcess) -> None:
    res = hostile(server, "/v1/completions", {"prompt": "Go:", "max_tokens": 8, "guided_json": BIG_SCHEMA})
    assert res["status"] == 400, res
    assert "took longer than 3 s (the limit, --grammar-compile-timeout)" in res["body"]["error"]["message"]
    assert res["seconds"] < 8  # (the 3 s limit, and the request's own work)
    # the refusal is remembered: the same schema again is refused at once
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "Go:", "max_tokens": 8, "guided_json": BIG_SCHEMA})
    assert r.status_code == 400 and time.monotonic() - t0 < 2.0  # (not the 3 s limit again)


def test_structured_output_still_works_afterwards(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Name a city in JSON."}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"city"}
