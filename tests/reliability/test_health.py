"""Hostile input cannot hurt other users: cache isolation, health that tells the truth,
deadlines, and what an engine process that dies does to the requests it had.

One server (the engine in a process of its own, two API keys, per-key cache isolation):
- cached_tokens leaks nothing across cache salts, nor across API keys;
- a request's `timeout` ends it within about that time (504 whole; a stream's finish chunk
  with "timeout", an error event, [DONE]); the server goes idle after;
- SIGSTOP of the engine process turns /health 503 within a few seconds (and refuses new
  requests); SIGCONT brings it back;
- SIGKILL of the engine process (last: the server cannot serve after it) ends an open
  stream, an open non-streaming request and two WebSocket sessions (one mid-turn, one idle)
  with 503-class errors / a 1011 close within seconds; /health is 503.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.reliability.conftest import REPO, ServerProcess

ALICE, BOB = "alice-key", "bob-key"
SERVER_ARGS = ["--engine-process", "--api-key", f"{ALICE},{BOB}", "--cache-isolation", "per-key"]
AUTH = {"Authorization": f"Bearer {ALICE}"}
PROMPT = "The radix cache keeps the prompts of earlier requests. " * 12  # well over 112 tokens
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.8}


def cached(server: ServerProcess, key: str, salt: str | None = None) -> int:
    body: dict = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def engine_pid(server: ServerProcess) -> int:
    """The engine process: the server's spawned child (not multiprocessing's resource tracker)."""
    children = [c for c in psutil.Process(server.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
    assert len(children) == 1, [c.cmdline() for c in children]
    return children[0].pid


def health(server: ServerProcess) -> int:
    return httpx.get(server.url + "/health", timeout=5).status_code


def poll(fn, want, timeout: float) -> float:
    """Seconds until fn() == want (polled every 50 ms); fails after timeout."""
    t0 = time.monotonic()
    while (got := fn()) != want:
        assert time.monotonic() - t0 < timeout, f"still {got} after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_cached_tokens_tell_nothing_across_salts_and_api_keys(server: ServerProcess) -> None:
    assert cached(server, ALICE) == 0
    hit = cached(server, ALICE)
    assert hit >= 112, "the same key and no salt: served from the cache"
    assert cached(server, ALICE, "s1") == 0, "another salt: nothing shared"
    assert cached(server, ALICE, "s1") == hit
    assert cached(server, BOB) == 0, "another API key (per-key isolation): nothing shared"
    assert cached(server, BOB, "s1") == 0, "the same salt under another key is another namespace"
    assert cached(server, BOB) == hit
    server.wait_idle()


def test_per_key_isolation_without_keys_is_refused_at_startup() -> None:
    cmd = [sys.executable, "-m", "streamer", "serve", "--model", "default", "--cache-isolation", "per-key"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--api-key" in proc.stderr, proc.stderr[-2000:]


def test_a_timeout_ends_a_long_request_within_about_its_time(server: ServerProcess) -> None:
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Tell me a story.", "timeout": 1.0, **LONG},
                   headers=AUTH, timeout=60)
    whole = time.monotonic() - t0
    err = r.json()["error"]
    assert r.status_code == 504 and err["code"] == "request_timeout" and "timed out" in err["message"], r.text

    t0 = time.monotonic()
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True, "timeout": 1.0, **LONG}
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    streamed = time.monotonic() - t0
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    finish = json.loads(events[-3])["choices"][0]
    assert error["code"] == "request_timeout" and finish["finish_reason"] == "timeout", events[-3:]
    assert sum(bool(json.loads(e)["choices"][0]["delta"].get("content")) for e in events[:-2]) > 0
    print(f"\ntimeout 1 s: whole request ended after {whole:.2f} s, stream after {streamed:.2f} s")
    assert whole < 3 and streamed < 3
    server.wait_idle()


def test_sigstop_of_the_engine_process_turns_health_503_and_sigcont_back(server: ServerProcess) -> None:
    pid = engine_pid(server)
    assert health(server) == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        to_503 = poll(lambda: health(server), 503, timeout=10)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH,
                       timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "stalled"
    finally:
        os.kill(pid, signal.SIGCONT)
    to_200 = poll(lambda: health(server), 200, timeout=10)
    print(f"\nSIGSTOP -> /health 503 in {to_503:.2f} s; SIGCONT -> 200 in {to_200:.2f} s")
    assert to_503 < 5
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


async def _sse(url: str, started: asyncio.Event) -> dict:
    res: dict = {"events": []}
    body = {"prompt": "Tell me a long story.", "stream": True, **LONG}
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body,
                                                              headers=AUTH) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                res["events"].append(line[6:])
                started.set()
    res["t"] = time.monotonic()
    return res


async def _plain(url: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(url + "/v1/completions", json={"prompt": "Write a long poem.", **LONG}, headers=AUTH)
    return {"status": r.status_code, "body": r.json(), "t": time.monotonic()}


async def _ws(url: str, started: asyncio.Event, turn: bool) -> dict:
    res: dict = {"messages": [], "code": None}
    async with connect(f"{url}/v1/chat/ws?api_key={ALICE}", open_timeout=30) as ws:
        res["messages"].append(json.loads(await ws.recv()))  # session
        if turn:
            await ws.send(json.dumps({"type": "user", "content": "Tell me a very long story.", **LONG}))
        else:
            started.set()
        try:
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                res["messages"].append(msg)
                if msg["type"] == "delta":
                    started.set()
        except ConnectionClosed as e:
            res["code"] = e.rcvd.code if e.rcvd else None
    res["t"] = time.monotonic()
    return res


def test_sigkill_of_the_engine_process_ends_every_open_request_with_503s(server: ServerProcess) -> None:
    """Last in the module: the server has no engine after it."""
    pid = engine_pid(server)

    async def scenario() -> tuple[float, dict, dict, dict, dict]:
        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(_sse(server.url, started[0])), asyncio.create_task(_plain(server.url)),
                 asyncio.create_task(_ws(server.ws_url, started[1], turn=True)),
                 asyncio.create_task(_ws(server.ws_url, started[2], turn=False))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        await asyncio.sleep(0.5)  # (the non-streaming one is surely generating too)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        sse, plain, ws_turn, ws_idle = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return killed, sse, plain, ws_turn, ws_idle

    killed, sse, plain, ws_turn, ws_idle = asyncio.run(scenario())
    took = {name: r["t"] - killed for name, r in
            [("stream", sse), ("non-streaming", plain), ("websocket turn", ws_turn), ("idle websocket", ws_idle)]}
    print("\nSIGKILL -> ended after " + ", ".join(f"{k} {v:.2f} s" for k, v in took.items()))

    assert sse["events"][-1] == "[DONE]"
    assert json.loads(sse["events"][-2])["error"]["code"] == "engine_down", sse["events"][-2:]
    assert plain["status"] == 503 and plain["body"]["error"]["code"] == "engine_down", plain
    for ws in (ws_turn, ws_idle):
        assert ws["code"] == 1011, ws
        assert ws["messages"][-1]["type"] == "error" and "engine is down" in ws["messages"][-1]["message"], ws
    assert all(t < 5 for t in took.values()), took
    assert health(server) == 503
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down", r.text
