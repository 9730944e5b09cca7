"""Raw Server-Sent Events: the exact chunk sequence, and what a client going away leaves behind."""

from __future__ import annotations

import json
import socket
import time

import httpx


def events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_chat_chunk_sequence(http):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = events(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "smol" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == []
    u = usage["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and "cached_tokens" in u[
        "prompt_tokens_details"]
    assert all("usage" not in c for c in chunks[:-1])


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens sent up to it."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hello"})):
        body = {**body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with http.stream("POST", path, json=body) as r:
            chunks = [json.loads(d) for d in events(r)[:-1]]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5 and counts[-2] == 5, (path, counts)
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n for c, n in zip(chunks, counts))
        assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1 and chunks[0]["usage"]["prompt_tokens"] > 0
        assert chunks[-1]["choices"] == []  # (include_usage's own chunk still ends the stream)


def test_completion_chunks_without_usage(http):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True, "logprobs": 1}
    with http.stream("POST", "/v1/completions", json=body) as r:
        data = events(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    texts = [c["choices"][0] for c in chunks[:-1]]
    assert all(t["logprobs"]["tokens"] and t["finish_reason"] is None for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_disconnect_aborts_and_frees_pages(live):
    """A client that goes away mid-stream: its request stops and every page is free or cached."""
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    before = live.stats().generated_tokens_total
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    got = b""
    while got.count(b"data: ") < 4:  # a few tokens streamed
        chunk = sock.recv(65536)
        assert chunk, got  # (closed before streaming)
        got += chunk
    assert b"200 OK" in got
    sock.close()
    stats = live.wait_idle()
    assert stats.running == 0 and stats.pages_used == stats.pages_cached
    assert stats.generated_tokens_total - before < 300  # it stopped long before max_tokens


def test_disconnect_during_non_streaming_request(live, http):
    before = live.stats().generated_tokens_total
    try:
        http.post("/v1/completions", json={"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True},
                  timeout=1.0)
    except httpx.TimeoutException:
        pass
    time.sleep(0.2)
    stats = live.wait_idle()
    assert stats.generated_tokens_total - before < 300
