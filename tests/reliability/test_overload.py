"""Overload: a server that runs one sequence and lets two wait refuses the rest with
503 + Retry-After, serves what it took in full, and gives full service afterwards."""

from __future__ import annotations

import asyncio
import json

import httpx
from websockets.sync.client import connect

from tests.reliability.conftest import ServerProcess

SERVER_ARGS = ["--max-num-seqs", "1", "--max-queue", "2"]
BURST = 12


async def one(client: httpx.AsyncClient, i: int) -> dict:
    if i % 2:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Say hi ({i})"}]}
    else:
        path, body = "/v1/completions", {"prompt": f"Once upon a time ({i})"}
    body.update(max_tokens=16, ignore_eos=True, stream=True)
    res: dict = {"i": i, "chunks": 0, "finish": None, "done": False}
    async with client.stream("POST", path, json=body) as r:
        res["status"] = r.status_code
        res["retry_after"] = r.headers.get("retry-after")
        if r.status_code != 200:
            res["body"] = json.loads(await r.aread())
            return res
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                res["done"] = True
            elif line.startswith("data: "):
                for c in json.loads(line[6:])["choices"]:
                    res["chunks"] += 1
                    res["finish"] = c["finish_reason"] or res["finish"]
    return res


async def burst(url: str, n: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n + 4)) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def test_overload_is_refused_with_retry_after_then_full_service(server: ServerProcess) -> None:
    results = asyncio.run(burst(server.url, BURST))
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    assert len(ok) + len(refused) == BURST, [r for r in results if r["status"] not in (200, 503)]
    print(f"\nburst of {BURST}: {len(ok)} served, {len(refused)} refused")
    assert len(ok) >= 1
    # one running and two waiting at a time; a request takes ~1 s, the burst arrives within a fraction of it
    assert len(refused) >= BURST // 2, f"only {len(refused)} of {BURST} refused by max-num-seqs 1 / max-queue 2"
    for r in refused:
        assert r["retry_after"] is not None and int(r["retry_after"]) >= 1, r
        assert r["body"]["error"]["type"] == "server_error" and r["body"]["error"]["code"] == "queue_full", r
    for r in ok:  # what was taken in is served in full
        assert r["done"] and r["finish"] == "length", r
    server.wait_idle(timeout=30)
    m = server.metrics()
    assert sum(v for k, v in m.items() if k.startswith("streamer_http_requests_total") and 'status="503"' in k) \
        == len(refused)

    # full service afterwards: as many requests as the server can hold at once, all served
    results = asyncio.run(burst(server.url, 2))
    assert all(r["status"] == 200 and r["done"] and r["finish"] == "length" for r in results), results
    for _ in range(3):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    with connect(server.ws_url + "/v1/chat/ws", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session"
        for turn in ("Hi", "And then?"):
            ws.send(json.dumps({"type": "user", "content": turn, "max_tokens": 4}))
            while (msg := json.loads(ws.recv(timeout=60)))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["finish_reason"] in ("stop", "length"), msg
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_idle(timeout=30)
