"""Hostile HTTP input cannot hurt other users: each attack is refused or answered within
seconds, while it is in flight a bystander's greedy streamed completion gets its first
token within 2 s, and afterwards /health is 200, nothing runs or holds KV pages
(wait_idle), and resident memory is back within 200 MB of where it was.

The attacker holds the API key (a user, not a stranger), so that the limits, not the key,
are what stops it. The server runs with a small queue, connection cap and idle timeout,
so that those limits are reached quickly.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.reliability.conftest import ServerProcess

KEY = "sk-hostile-secret-0451"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE_TIMEOUT = 2.0
MAX_CONNECTIONS = 100
MAX_QUEUE = 32
SERVER_ARGS = ["--api-key", KEY, "--max-queue", str(MAX_QUEUE), "--max-connections", str(MAX_CONNECTIONS),
               "--timeout-idle-connection", str(IDLE_TIMEOUT)]
BYSTANDER = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}
FIRST_TOKEN_LIMIT = 2.0
RSS_SLACK = 200 << 20
POSTS = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/apply_chat_template"]
MB = 1 << 20
T = TypeVar("T")
MEASURED: dict[str, Any] = {"first_token_s": {}, "rss_mb": {}}


def client(server: ServerProcess, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=kw.pop("timeout", 30), **kw)


def bystander(server: ServerProcess) -> float:
    """One short greedy streamed completion, read to the end; seconds to its first token."""
    t0 = time.monotonic()
    first = None
    with client(server) as c, c.stream("POST", "/v1/completions", json=BYSTANDER) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and any(ch["text"] for ch in json.loads(line[6:])["choices"]):
                first = time.monotonic() - t0
    assert first is not None
    return first


def under_attack(server: ServerProcess, name: str, attack: Callable[[], T], limit: float = 20.0) -> T:
    """Run attack() in a thread; bystanders one after another until it is over (at least one)."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = attack()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    firsts = [bystander(server)]
    while thread.is_alive() and len(firsts) < 20:
        firsts.append(bystander(server))
    thread.join(limit)
    assert not thread.is_alive(), f"{name}: still running after {limit} s"
    MEASURED["first_token_s"][name] = (round(max(firsts), 3), len(firsts), round(out["seconds"], 2))
    if "error" in out:
        raise out["error"]
    assert max(firsts) < FIRST_TOKEN_LIMIT, f"{name}: a bystander waited {max(firsts):.2f} s for its first token"
    assert out["seconds"] < limit
    return out["value"]


@pytest.fixture(scope="module")
def baseline(server: ServerProcess) -> Iterator[int]:
    for _ in range(5):  # warm: the server's first requests (and its helper processes') allocate for good
        bystander(server)
    rss = server.rss()
    MEASURED["rss_mb"]["start"] = rss // MB
    yield rss
    print(f"\nhostile HTTP: bystander (worst first token s, bystanders, attack s) {MEASURED['first_token_s']}\n"
          f"  RSS MB {MEASURED['rss_mb']}")


@pytest.fixture(autouse=True)
def unharmed(request: pytest.FixtureRequest, server: ServerProcess, baseline: int) -> Iterator[None]:
    yield
    assert server.alive(), server.log_tail()
    deadline = time.monotonic() + 10
    while True:  # (a test may have just filled the connections: they go within the idle timeout)
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "/health is not 200"
        time.sleep(0.1)
    server.wait_idle(timeout=10)
    rss = server.rss()
    MEASURED["rss_mb"][request.node.name.removeprefix("test_")] = rss // MB
    assert rss < baseline + RSS_SLACK, f"RSS {rss // MB} MB, {(rss - baseline) // MB} MB above the start"


def error_of(r: httpx.Response, status: int, flag: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if flag is not None:
        assert flag in err["message"], err
    return err


def raw(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_response(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it has sent a whole response head and body, or closed."""
    s.settimeout(timeout)
    data = b""
    while True:
        chunk = s.recv(65536)
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        if not chunk or (sep and length is not None and len(body) >= length):
            return data


# ---- bodies ------------------------------------------------------------------------------------


def test_huge_body_with_content_length_is_413_before_it_is_read(server: ServerProcess) -> None:
    def attack() -> bytes:
        with raw(server) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 52428800\r\n\r\n")
            s.sendall(b'{"prompt": "' + b"a" * MB)  # 1 of the 50 MB: the answer comes without the rest
            return read_response(s)

    answer = under_attack(server, "50 MB body, Content-Length", attack)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]


def test_huge_chunked_body_is_cut_off_at_the_limit(server: ServerProcess) -> None:
    def attack() -> tuple[int, bytes]:
        chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024)
        sent = 0
        with raw(server) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            while sent < 50 * MB and not select.select([s], [], [], 0)[0]:
                s.sendall(chunk)
                sent += 64 * 1024
            return sent, read_response(s)

    sent, answer = under_attack(server, "50 MB chunked body", attack)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    # refused at the limit (8 MiB), long before the end; the rest of what was sent sat in the
    # loopback's socket buffers (several MB each way)
    assert sent < 25 * MB, f"{sent / MB:.0f} MB sent before the refusal"
    assert b"--max-request-bytes" in answer


def test_long_prompt_is_refused_before_tokenizing(server: ServerProcess) -> None:
    prompt = "word " * 1_000_000  # 5 MB: tokenizing it would hold the engine's tokenizer for seconds

    def attack() -> list[httpx.Response]:
        with client(server) as c:
            return [c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}),
                    c.post("/generate", json={"text": [prompt[:200_000]] * 2}),  # summed over the batch
                    c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})]

    for r in under_attack(server, "5 MB prompt", attack):
        error_of(r, 400, "--max-prompt-chars")


def test_huge_stop_list_is_refused(server: ServerProcess) -> None:
    stop = [f"stop{i:06d}" for i in range(400_000)]  # ~4.4 MB of JSON

    def attack() -> httpx.Response:
        with client(server) as c:
            return c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stop": stop})

    assert error_of(under_attack(server, "4 MB stop list", attack), 400, "--max-stop")["param"] == "stop"
    with client(server) as c:
        err = error_of(c.post("/generate", json={"text": "Hi", "sampling_params": {"stop": ["x" * 10_000]}}), 400)
        assert "--max-stop-chars" in err["message"] and err["param"] == "sampling_params.stop"


def test_huge_logit_bias_with_n_is_refused(server: ServerProcess) -> None:
    bias = {str(t): -1.0 for t in range(49_000)}

    def attack() -> httpx.Response:
        with client(server) as c:
            return c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16, "n": 64, "logit_bias": bias})

    assert error_of(under_attack(server, "n=64, 49k logit_bias", attack), 400, "--max-logit-bias")["param"] == \
        "logit_bias"
    with client(server) as c:
        error_of(c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 1000}), 400, "--max-n")


def test_many_conversations_are_refused_off_the_loop(server: ServerProcess) -> None:
    many = [[{"role": "user", "content": "hi"}]] * 200_000  # ~7 MB

    def attack() -> httpx.Response:
        with client(server) as c:
            return c.post("/apply_chat_template", json={"conversations": many})

    error_of(under_attack(server, "200k conversations", attack), 400, "--max-conversations")
    ok = [[{"role": "user", "content": f"question {i} " * 50}] for i in range(256)]  # the most allowed, rendered

    def most() -> httpx.Response:
        with client(server) as c:
            return c.post("/apply_chat_template", json={"conversations": ok})

    r = under_attack(server, "256 conversations", most)
    assert r.status_code == 200 and len(r.json()["texts"]) == 256
    with client(server) as c:
        error_of(c.post("/tokenize", json={"text": "word " * 60_000}), 400, "--max-prompt-chars")
        error_of(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}] * 2000}),
                 400, "--max-messages")


# ---- the native API under the same admission ---------------------------------------------------


def test_generate_batches_are_admitted_by_their_prompts(server: ServerProcess) -> None:
    def attack() -> list[httpx.Response]:
        with client(server) as c:
            body = {"sampling_params": {"max_tokens": 64, "ignore_eos": True}}
            return [c.post("/generate", json={"text": ["Once upon a time"] * 1200, **body}),
                    c.post("/generate", json={"text": ["Once upon a time"] * (MAX_QUEUE + 1), **body})]

    too_big, over_queue = under_attack(server, "1,200-prompt /generate", attack)
    error_of(too_big, 400, "--max-batch")
    error_of(over_queue, 400, "--max-queue")
    m = server.metrics()
    assert m["streamer_requests_running"] == 0 and m["streamer_requests_waiting"] == 0  # nothing was started


def aborts(server: ServerProcess) -> float:
    return server.metrics().get('streamer_requests_finished_total{finish_reason="abort"}', 0.0)


def test_a_generate_batch_whose_client_leaves_is_aborted(server: ServerProcess) -> None:
    before = aborts(server)
    body = {"text": [f"Tell me a long story ({i})" for i in range(8)],
            "sampling_params": {"max_tokens": 2000, "ignore_eos": True}}
    with client(server, timeout=httpx.Timeout(30, read=1.5)) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=body)  # gives up after 1.5 s, and closes the connection
    t0 = time.monotonic()
    m = server.wait_idle(timeout=5)
    assert m["streamer_requests_running"] == 0
    assert aborts(server) - before >= 8
    # streaming: the client reads one event and goes
    with client(server) as c, c.stream("POST", "/generate", json={**body, "text": "Tell me a story",
                                                                   "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    server.wait_idle(timeout=5)
    assert aborts(server) - before >= 9
    MEASURED["abort_to_idle_s"] = round(time.monotonic() - t0, 2)


# ---- malformed input ---------------------------------------------------------------------------


def test_deep_json_and_booleans_as_token_ids_are_400(server: ServerProcess) -> None:
    deep = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
            b'{"input_ids": ' + b"[" * 50_000 + b"]" * 50_000 + b', "text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            b'{"conversations": [[{"role": "user", "content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]]}",
            b'{"messages": [{"role": "user", "content": "hi"}], "guided_json": ' + b'{"a":' * 20_000 + b"1" +
            b"}" * 20_000 + b"}",
            b'{"text": "x", "sampling_params": {"json_schema": ' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b"}}"]
    with client(server) as c:
        for path in POSTS:
            for body in deep:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                error_of(r, 400)
        for path, body in [("/generate", {"input_ids": [1, True, 2]}), ("/generate", {"input_ids": [[True]]}),
                           ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [False]}}),
                           ("/v1/completions", {"prompt": [True, 1]}), ("/v1/completions", {"prompt": [[1, True]]}),
                           ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]})]:
            err = error_of(c.post(path, json=body), 400)
            assert "bool" in err["message"], err


def test_cross_site_posts_are_415(server: ServerProcess) -> None:
    with client(server) as c:
        for path in POSTS:
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                r = c.post(path, content=b'{"prompt": "hi", "text": "hi"}', headers={"content-type": ctype})
                assert error_of(r, 415)["code"] == "unsupported_media_type"
            r = c.post(path, content=b"{}")  # no Content-Type at all (fetch() of a Blob sends none)
            assert r.status_code == 415


# ---- connections -------------------------------------------------------------------------------


def test_idle_connections_are_closed_and_new_clients_served(server: ServerProcess) -> None:
    socks = [raw(server) for _ in range(300)]  # 3x the cap, never a byte
    t0 = time.monotonic()
    try:
        open_ = {s.fileno(): s for s in socks}
        refused = 0
        while open_ and time.monotonic() - t0 < IDLE_TIMEOUT + 3:
            ready, _, _ = select.select(list(open_.values()), [], [], 0.2)
            for s in ready:
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    data = b""
                refused += data.startswith(b"HTTP/1.1 503")
                if not data:
                    del open_[s.fileno()]
        closed_in = time.monotonic() - t0
        assert not open_, f"{len(open_)} idle connections still open after {closed_in:.1f} s"
    finally:
        for s in socks:
            s.close()
    assert refused >= 300 - MAX_CONNECTIONS - 5, refused  # beyond the cap: a 503 at once
    MEASURED["idle_300_closed_s"] = round(closed_in, 2)
    assert closed_in < IDLE_TIMEOUT + 2
    bystander(server)  # a normal client is served


def test_slowloris_headers_are_cut_off(server: ServerProcess) -> None:
    def attack() -> float:
        with raw(server) as s:
            t0 = time.monotonic()
            s.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            try:
                for i in range(100):  # a header line every 0.1 s, never the end of the head
                    s.send(b"X-Slow-%d: 1\r\n" % i)
                    time.sleep(0.1)
            except OSError:  # reset / broken pipe: the server has closed it
                pass
            return time.monotonic() - t0

    assert under_attack(server, "slowloris head", attack) < IDLE_TIMEOUT + 1

    def huge_head() -> bytes:  # the opposite: a head of one endless header line, as fast as it goes
        with raw(server) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            try:
                for _ in range(1000):
                    s.sendall(b"a" * 65536)
                return b"sent 64 MB"
            except OSError:
                try:
                    return s.recv(4096)
                except OSError:
                    return b"reset"

    answer = under_attack(server, "64 MB head", huge_head)
    assert answer.startswith(b"HTTP/1.1 431") or answer == b"reset", answer[:200]


# ---- who may call --------------------------------------------------------------------------------


def test_foreign_host_and_origin_are_refused(server: ServerProcess) -> None:
    with client(server) as c:
        err = error_of(c.get("/v1/models", headers={"Host": "evil.example"}), 421, "--allowed-hosts")
        assert err["code"] == "host_not_allowed"
        assert c.get("/health", headers={"Host": "evil.example:8000"}).status_code == 421
        assert c.get("/health", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    url = f"{server.ws_url}/v1/chat/ws?api_key={KEY}"
    for origin in ("https://evil.example", "null"):
        with pytest.raises(InvalidStatus) as e:
            connect(url, origin=origin, open_timeout=10)  # type: ignore[arg-type]
        assert e.value.response.status_code == 403
    with connect(url, origin=f"http://127.0.0.1:{server.port}", open_timeout=10) as ws:  # type: ignore[arg-type]
        assert json.loads(ws.recv(timeout=10))["type"] == "session"  # the chat page's own origin


def test_websocket_messages_and_turns_are_bounded(server: ServerProcess) -> None:
    url = f"{server.ws_url}/v1/chat/ws?api_key={KEY}"
    with connect(url, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session"
        ws.send(json.dumps({"type": "user", "content": "word " * 100_000, "max_tokens": 2}))  # 500 k characters
        msg = json.loads(ws.recv(timeout=10))
        assert msg["type"] == "error" and "--max-prompt-chars" in msg["message"], msg
        ws.send(json.dumps({"type": "user", "content": "Hi", "max_tokens": 2, "stop": ["x"] * 1000}))
        msg = json.loads(ws.recv(timeout=10))
        assert msg["type"] == "error" and "--max-stop" in msg["message"], msg
        ws.send(json.dumps({"type": "user", "content": "Hi", "max_tokens": 2}))  # the session goes on
        while (msg := json.loads(ws.recv(timeout=30)))["type"] == "delta":
            pass
        assert msg["type"] == "done", msg
    with connect(url, open_timeout=10) as ws, pytest.raises(ConnectionClosed) as e:
        ws.recv(timeout=10)
        ws.send("x" * (9 * MB))  # over --max-request-bytes (8 MiB)
        ws.recv(timeout=10)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009


def test_api_key_never_reaches_the_log(server: ServerProcess) -> None:
    with connect(f"{server.ws_url}/v1/chat/ws?api_key={KEY}", open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session"
    httpx.get(f"{server.url}/v1/models?api_key={KEY}", headers=AUTH, timeout=10)
    deadline = time.monotonic() + 5
    while "api_key=***" not in server.log_text():  # the records are written by then
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)
    assert KEY not in server.log_text()
