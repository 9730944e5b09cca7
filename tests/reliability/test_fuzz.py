"""Fuzzing every endpoint of the server's OpenAPI document, plus malformed bodies.

Three sources of bad input, about 70 s in all (most of it schemathesis's coverage phase):

  1. schemathesis (`st run` on GET /openapi.json): positive and negative
     cases from the schemas, coverage (boundary) cases, and other methods on
     every path, with the check not_a_server_error: one pass of every
     phase over every operation, SCHEMATHESIS_EXAMPLES fuzzed cases each (a
     time budget instead repeats the fuzzing pass with fresh data until it is
     spent). The hooks in fuzz_hooks.py only keep the generation work small.
  2. hypothesis: bodies built from the schemas' property names with values
     of any JSON type, arbitrary JSON documents, and raw bytes; plus a fixed
     list of malformed JSON (truncated, invalid UTF-8, lone surrogates, deep
     nesting, huge numbers, NaN), odd content types, methods and paths.
  3. malformed WebSocket frames on /v1/chat/ws; the session must survive.

Throughout, a normal greedy request runs in a loop beside the fuzz: every one
must succeed with the same text as before the fuzz. No response may be a
5xx, and the server must stay up.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.reliability.conftest import REPO, VENV_BIN, ServerProcess
from tests.reliability.fuzz_hooks import steer

# the engine in a process of its own, as on CUDA (on CPU the default is one process):
# every request crosses the socket to the engine process (the fuzz found a request msgpack could not carry)
SERVER_ARGS = ["--engine-process"]

SCHEMATHESIS_EXAMPLES = 10
NORMAL = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
          "stream": True}


def normal_request(client: httpx.Client) -> dict[str, Any]:
    text, finish, done, status = [], None, False, None
    with client.stream("POST", "/v1/completions", json=NORMAL) as r:
        status = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    text.append(c["text"])
                    finish = c["finish_reason"] or finish
    return {"status": status, "text": "".join(text), "finish": finish, "done": done}


class NormalTraffic(threading.Thread):
    """Normal requests one after another until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.results, self.errors = url, [], []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                try:
                    self.results.append(normal_request(client))
                except Exception as e:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(e))


FINDINGS: list[str] = []
"""Every 5xx seen: the fuzz goes on after one, so that a run reports them all."""


def check(r: httpx.Response, what: Any) -> None:
    if r.status_code >= 500:
        FINDINGS.append(f"{r.status_code} for {what!r}: {r.text[:300]}")


def send(client: httpx.Client, method: str, path: str, what: Any, **kw: Any) -> None:
    """One request, checked. A broken connection is retried once on a fresh one (after a 500 the
    server closes the connection the client may be about to reuse); broken twice is a finding."""
    for attempt in (1, 2):
        try:
            check(client.request(method, path, **kw), what)
            return
        except httpx.TransportError as e:
            if attempt == 2:
                FINDINGS.append(f"connection error {e!r} for {what!r}")


# ---- 1. schemathesis ------------------------------------------------------------------------


def run_schemathesis(server: ServerProcess, workdir: Path) -> str:
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.reliability.fuzz_hooks",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [str(VENV_BIN / "st"), "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", str(SCHEMATHESIS_EXAMPLES), "--workers", "1", "--request-timeout", "60",
           "--seed", "0", "--suppress-health-check", "all", "--no-color"]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"schemathesis found failures (exit {proc.returncode}):\n{out[-6000:]}\n" \
                                 f"server log:\n{server.log_tail()}"
    spec = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    operations = sum(len(methods) for methods in spec["paths"].values())  # (every route is fuzzed)
    assert f"{operations} selected" in out or f"Tested: {operations}" in out, out[-3000:]
    return out


# ---- 2. hypothesis + malformed --------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

MALFORMED: list[bytes] = [
    b"", b"{", b"}", b"[", b"null", b"true", b"0", b'"text"', b"[]", b"{}", b"{{}}", b'{"prompt": }',
    b'{"prompt": "a",}', b'{"prompt": "a"', b"\xff\xfe\x00\x01", b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    b'{"prompt": "\\ud800", "max_tokens": 2}', b'{"prompt": "a\\u0000b", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2',
    b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": "hi", "max_tokens": NaN}', b'{"prompt": "hi", "temperature": Infinity, "max_tokens": 2}',
    b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 2}', b'{"prompt": [-1], "max_tokens": 2}',
    b'{"prompt": [1099511627776], "max_tokens": 2}', b'{"prompt": [[]], "max_tokens": 2}',
    b'{"prompt": [[1], "a"], "max_tokens": 2}', b'{"prompt": "hi", "max_tokens": 2, "stop": [""]}',
    b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"0": 1e308}}',
    b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"-5": 1}}',
    b'{"prompt": "hi", "max_tokens": 2, "stop_token_ids": [-1, 99999999999]}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_regex": "("}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_regex": "(a*)*b{99999}"}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_json": "{"}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_json": {"type": "nonsense"}}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_grammar": "root ::= root"}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_grammar": "::="}',
    b'{"prompt": "hi", "max_tokens": 2, "guided_choice": [""]}',
    b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}',
    b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", '
    b'"json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}',
    b'{"prompt": "hi", "max_tokens": 2, "seed": 9223372036854775807, "temperature": 2}',
    b'{"prompt": "hi", "max_tokens": 1, "n": 64}', b'{"prompt": "hi", "max_tokens": 2, "logprobs": 20}',
    b'{"prompt": "hi", "max_tokens": 2, "min_tokens": 5}', b'{"prompt": "hi", "max_tokens": 2, "top_k": 0}',
    b'{"prompt": "hi", "max_tokens": 2, "top_p": 1e-300, "min_p": 1}',
    b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 10, "presence_penalty": -2}',
    b'{"prompt": "hi", "max_tokens": 100000000}', b'{"prompt": "' + b"word " * 20_000 + b'", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": true, "top_logprobs": 20}',
    b'{"messages": [{"role": "nobody", "content": "hi"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": null}], "max_tokens": 2}',
    b'{"messages": [{"role": "assistant", "content": "only me"}], "max_tokens": 2, "add_generation_prompt": false}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "stream": true, '
    b'"stream_options": {"include_usage": true}, "n": 3}',
]


def schema_properties(doc: dict[str, Any]) -> dict[str, list[str]]:
    """POST path -> the property names of its request body schema, those of every alternative of
    a oneOf (/invocations') together (POSTs without a body, such as
    /v1/responses/{response_id}/cancel, left out)."""
    comps = doc["components"]["schemas"]
    out = {}
    for path, item in doc["paths"].items():
        if "requestBody" in item.get("post", {}):
            schema = item["post"]["requestBody"]["content"]["application/json"]["schema"]
            refs = [s["$ref"] for s in schema.get("oneOf", [schema])]
            out[path] = sorted({p for ref in refs for p in comps[ref.rsplit("/", 1)[1]]["properties"]})
    return out


def fuzz_http(server: ServerProcess) -> int:
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    props = schema_properties(doc)
    sent = 0
    with httpx.Client(base_url=server.url, timeout=120) as client:
        # methods, paths, content types
        for path in [*doc["paths"], "/", "/openapi.json", "/v1/chat/ws", "/nowhere", "/v1/completions/",
                     "/v1/%00", "/v1/" + "a" * 5000, "/static/../app.py"]:
            for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"):
                send(client, method, path, (method, path), content=b"{}")
                sent += 1
        for path in props:
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
                body = b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
                send(client, "POST", path, (path, ctype), content=body, headers={"content-type": ctype})
                send(client, "POST", path + "?stream=true&max_tokens=99999", (path, ctype), content=b"prompt=hi",
                     headers={"content-type": ctype})
                sent += 2
            for body in MALFORMED:
                send(client, "POST", path, (path, body[:200]), content=body,
                     headers={"content-type": "application/json"})
                sent += 1

        counter = {"n": 0}

        def post(path: str, content: bytes) -> None:
            counter["n"] += 1
            send(client, "POST", path, (path, content[:300]), content=content,
                 headers={"content-type": "application/json"})

        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def fuzz_fields(data: st.DataObject) -> None:
            path = data.draw(st.sampled_from(sorted(props)))
            names = data.draw(st.lists(st.sampled_from(props[path]), max_size=6, unique=True))
            body = {name: data.draw(JSON, label=name) for name in names}
            if path.endswith("chat/completions"):
                body.setdefault("messages", [{"role": "user", "content": "hi"}])
            else:
                body.setdefault("prompt", "hi")
            post(path, json.dumps(steer(body)).encode())

        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(sorted(props)), doc=JSON, raw=st.binary(max_size=200))
        def fuzz_documents(path: str, doc: Any, raw: bytes) -> None:
            post(path, json.dumps(steer(doc)).encode())
            post(path, raw)

        fuzz_fields()
        fuzz_documents()
        sent += counter["n"]
    return sent


# ---- 3. WebSocket frames ------------------------------------------------------------------


def fuzz_websocket(server: ServerProcess) -> None:
    frames: list[str | bytes] = [
        b"\x00\xff\x10", "not json", "{}", "[]", '{"type": 5}', '{"type": "nope"}', '{"type": "user"}',
        '{"type": "user", "content": ""}', '{"type": "user", "content": "hi", "max_tokens": -1}',
        '{"type": "user", "content": "hi", "max_tokens": 2, "n": 2}',
        '{"type": "user", "content": "hi", "max_tokens": 2, "temperature": "hot"}',
        '{"type": "user", "content": "hi", "max_tokens": 2, "guided_regex": "("}',
        '{"type": "user", "content": "' + "word " * 20_000 + '", "max_tokens": 2}',
        '{"type": "user", "content": "\\ud800", "max_tokens": 2}',
        '{"type": "user", "x": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}",
        '{"type": "reset"}',
    ]
    url = server.ws_url + "/v1/chat/ws"

    def session() -> Any:
        ws = connect(url, open_timeout=30, max_size=None)
        assert json.loads(ws.recv(timeout=30))["type"] == "session"
        return ws

    ws = session()
    try:
        for frame in frames:
            try:
                ws.send(frame)
                while True:  # until the frame's answer: an error, a reset, or a turn's done
                    msg = json.loads(ws.recv(timeout=120))
                    if msg["type"] in ("error", "reset", "done"):
                        break
                    assert msg["type"] == "delta", msg
            except ConnectionClosed as e:
                FINDINGS.append(f"WebSocket session closed ({e}) after the frame {frame[:120]!r}")
                ws = session()
        ws.send('{"type": "user", "content": "Hello there", "max_tokens": 3}')
        while (msg := json.loads(ws.recv(timeout=120)))["type"] == "delta":
            pass
        assert msg["type"] == "done" and msg["finish_reason"] in ("stop", "length"), msg
    finally:
        ws.close()


# ---- the test ----------------------------------------------------------------------------------


def test_fuzz_every_endpoint(server: ServerProcess, tmp_path: Path) -> None:
    FINDINGS.clear()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        reference = normal_request(client)
    assert reference["status"] == 200 and reference["finish"] == "length" and reference["done"], reference

    normal = NormalTraffic(server.url)
    normal.start()
    t0 = time.monotonic()
    try:
        out = run_schemathesis(server, tmp_path)
        t1 = time.monotonic()
        sent = fuzz_http(server)
        t2 = time.monotonic()
        fuzz_websocket(server)
    finally:
        normal.stop.set()
        normal.join(120)
    t3 = time.monotonic()
    cases = next((line.strip() for line in out.splitlines() if "generated," in line), "?")
    print(f"\nschemathesis {t1 - t0:.0f} s ({cases}); {sent} malformed / hypothesis requests in {t2 - t1:.0f} s; "
          f"WebSocket frames {t3 - t2:.0f} s; {len(normal.results)} normal requests beside them")

    assert server.alive(), server.log_tail()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert not normal.errors, normal.errors[:3]
    assert normal.results, "no normal request completed during the fuzz"
    for r in normal.results:
        assert r == reference, f"a normal request was affected by the fuzz: {r} != {reference}"
    server.wait_idle(timeout=30)
    assert not FINDINGS, f"{len(FINDINGS)} server errors:\n" + "\n".join(FINDINGS[:20])
