"""200 concurrent streaming requests, half of which hang up mid-stream.

Afterwards the server must hold nothing for them: no running or waiting
request, and every KV page either free or held by the prefix cache
(pages_used == pages_cached). The clients that stayed must each get their
whole stream (a finish chunk and [DONE]).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from streamer.sse import DONE, parse_line
from tests.reliability.conftest import ServerProcess

# the engine in a process of its own, as on CUDA (on CPU the default is one process):
# aborts cross the socket to the engine process
SERVER_ARGS = ["--engine-process"]

N = 200
QUESTIONS = ["Tell me about rivers.", "Why do cats purr?", "What is a prime number?", "Describe a forest.",
             "How do airplanes fly?", "What is your favourite colour?", "Write a short poem.", "Hello!"]


def request(i: int) -> tuple[str, dict]:
    """Alternate chat and text completions; the ones that hang up ask for many tokens so they are
    surely mid-stream when they go (the others ask for 8)."""
    leaves = i % 2 == 1
    sampling = {"max_tokens": 64 if leaves else 8, "ignore_eos": leaves, "stream": True, "temperature": 0.8,
                "seed": i}
    q = f"{random.Random(i).choice(QUESTIONS)} ({i})"
    if (i // 2) % 2 == 0:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": q}], **sampling}
    return "/v1/completions", {"prompt": f"Question: {q}\nAnswer:", **sampling}


async def one(client: httpx.AsyncClient, i: int) -> dict:
    path, body = request(i)
    leaves = i % 2 == 1
    res = {"i": i, "status": None, "content": 0, "finish": None, "done": False, "error": None, "left": False}
    try:
        async with client.stream("POST", path, json=body) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                res["error"] = (await r.aread()).decode(errors="replace")[:300]
                return res
            async for line in r.aiter_lines():
                chunk = parse_line(line)
                if chunk is None:
                    continue
                if chunk == DONE:
                    res["done"] = True
                    break
                assert isinstance(chunk, dict)
                if "error" in chunk:
                    res["error"] = chunk["error"]
                    break
                for c in chunk["choices"]:
                    text = c.get("text") if "text" in c else c.get("delta", {}).get("content")
                    if text:
                        res["content"] += 1
                    res["finish"] = c.get("finish_reason") or res["finish"]
                if leaves and res["content"] >= 1:
                    res["left"] = True
                    break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        res["error"] = repr(e)
    return res


async def storm(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=N + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(180.0), limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(N)))


def test_half_of_200_streams_disconnect(server: ServerProcess) -> None:
    t0 = time.monotonic()
    results = asyncio.run(storm(server.url))
    elapsed = time.monotonic() - t0
    stayed = [r for r in results if r["i"] % 2 == 0]
    left = [r for r in results if r["i"] % 2 == 1]
    bad = [r for r in stayed if r["status"] != 200 or r["error"] or not r["done"] or r["finish"] not in ("stop", "length")]
    assert not bad, f"{len(bad)} complete streams failed, e.g. {bad[:3]}\n{server.log_tail()}"
    not_left = [r for r in left if r["status"] != 200 or r["error"] or not r["left"] or r["finish"] is not None]
    assert not not_left, f"{len(not_left)} streams did not get to disconnect mid-stream, e.g. {not_left[:3]}"

    m = server.wait_idle(timeout=10)  # raises with the gauges when something stays held
    assert m["streamer_kv_pages_free"] + m["streamer_kv_pages_cached"] == m["streamer_kv_pages_total"]
    assert server.alive()
    finished = {k: v for k, v in m.items() if k.startswith("streamer_requests_finished_total")}
    print(f"\n200 streams in {elapsed:.1f} s; finished by reason: {finished}")
    aborted = sum(v for k, v in finished.items() if 'finish_reason="abort"' in k)
    assert aborted >= N // 2, "every stream that hung up is counted as aborted"
    assert sum(finished.values()) >= N
    # and the server still answers normally
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
