"""SIGTERM with requests in flight: a clean, prompt shutdown.

Streams (chat and completions), a non-streaming request and a WebSocket turn
are all mid-generation when the server gets SIGTERM. Every SSE client must
get a final chunk with a finish_reason and then [DONE]; the non-streaming
client a complete response (or a clean 503); the WebSocket client its turn's
done or a clean close (a close frame). The process must exit on its own, soon, after
uvicorn's orderly shutdown.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.reliability.conftest import ServerProcess

# the engine in a process of its own, as on CUDA (on CPU the default is one process):
# SIGTERM reaches the server process, which stops the engine process in order
SERVER_ARGS = ["--engine-process"]
FRESH_SERVER = True  # (conftest.py) SIGTERM ends it, and its whole log is read

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.8}


class Client(threading.Thread):
    def __init__(self, name: str) -> None:
        super().__init__(daemon=True, name=name)
        self.started_generating = threading.Event()
        self.result: dict = {"name": name}

    def run(self) -> None:
        try:
            self.work()
        except Exception as e:  # noqa: BLE001 - judged by the test
            self.result["exception"] = repr(e)
        finally:
            self.started_generating.set()


class SSEClient(Client):
    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(f"sse {path}")
        self.url, self.path, self.body = url, path, body

    def work(self) -> None:
        res = self.result
        res.update(chunks=0, finish=None, done=False, after_done=[])
        with httpx.Client(base_url=self.url, timeout=60) as c, c.stream("POST", self.path, json=self.body) as r:
            res["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if res["done"]:
                    res["after_done"].append(line)
                elif line == "data: [DONE]":
                    res["done"] = True
                else:
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for ch in chunk["choices"]:
                        text = ch.get("text") if "text" in ch else ch["delta"].get("content")
                        if text:
                            res["chunks"] += 1
                            self.started_generating.set()
                        res["finish"] = ch["finish_reason"] or res["finish"]


class PlainClient(Client):
    def __init__(self, url: str) -> None:
        super().__init__("non-streaming")
        self.url = url

    def work(self) -> None:
        body = {"prompt": "Write a long story about a dragon.", **LONG}
        with httpx.Client(base_url=self.url, timeout=60) as c:
            threading.Timer(2.0, self.started_generating.set).start()  # no way to see its progress
            r = c.post("/v1/completions", json=body)
        self.result["status"] = r.status_code
        self.result["body"] = r.json()


class WSClient(Client):
    def __init__(self, url: str) -> None:
        super().__init__("websocket")
        self.url = url

    def work(self) -> None:
        res = self.result
        res.update(deltas=0, done=None, closed=None)
        with connect(self.url + "/v1/chat/ws", open_timeout=30) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "session"
            ws.send(json.dumps({"type": "user", "content": "Tell me a very long story.", **LONG}))
            try:
                while True:
                    msg = json.loads(ws.recv(timeout=60))
                    if msg["type"] == "delta":
                        res["deltas"] += 1
                        self.started_generating.set()
                    else:
                        res["done"] = msg
                        break
                ws.recv(timeout=60)  # then the server closes the session
            except ConnectionClosed as e:  # judged by the test: a close frame, and which code
                res["closed"] = e.rcvd.code if e.rcvd else "no close frame"


def test_sigterm_with_requests_in_flight(server: ServerProcess) -> None:
    url = server.url
    clients: list[Client] = [
        SSEClient(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}],
                                                 "stream": True, "stream_options": {"include_usage": True}, **LONG}),
        SSEClient(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 1000."}],
                                                 "stream": True, "n": 2, **LONG}),
        SSEClient(url, "/v1/completions", {"prompt": "The history of the world:", "stream": True, **LONG}),
        SSEClient(url, "/v1/completions", {"prompt": [[1, 2, 3], [4, 5, 6]], "stream": True, **LONG}),
        PlainClient(url),
        WSClient(server.ws_url),
    ]
    for c in clients:
        c.start()
    for c in clients:
        assert c.started_generating.wait(120), f"{c.name} never started generating"
    assert all("exception" not in c.result for c in clients), [c.result for c in clients]

    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for c in clients:
        c.join(60)
    clients_done = time.monotonic() - t0
    try:
        rc = server.proc.wait(60)
    finally:
        log = server.log_text()
    exited = time.monotonic() - t0
    ws = clients[-1].result
    print(f"\nclients finished {clients_done:.1f} s and the server exited {exited:.1f} s after SIGTERM (status {rc}); "
          f"WebSocket turn: done={ws.get('done')}, close code {ws.get('closed')}")

    for c in clients:
        assert not c.is_alive(), f"{c.name} still waiting 60 s after SIGTERM"
        res = c.result
        assert "exception" not in res, f"{c.name}: {res}\n{log[-3000:]}"
        if isinstance(c, SSEClient):
            assert res["status"] == 200 and res["chunks"] > 0, res
            assert res["finish"] is not None and res["done"] and not res["after_done"], (
                f"{c.name} did not end with a finish chunk and [DONE]: {res}")
        elif isinstance(c, PlainClient):
            assert res["status"] in (200, 503), res
            if res["status"] == 200:
                assert all(ch["finish_reason"] is not None for ch in res["body"]["choices"]), res
        else:
            # the turn's done, or a clean close: a close frame with going away (1001) or service restart
            # (1012, what uvicorn sends to WebSockets still open when it shuts down)
            assert res["done"] is not None or res["closed"] in (1000, 1001, 1012), res
            if res["done"] is not None:
                assert res["done"]["type"] == "done" and res["done"]["finish_reason"] is not None, res
    # uvicorn re-raises the SIGTERM it caught once it has shut down, so -15 is its orderly exit status
    assert rc in (0, -signal.SIGTERM), f"exit status {rc}\n{log[-3000:]}"
    assert "Application shutdown complete" in log and "Traceback" not in log, log[-5000:]
    assert exited < 30, f"shutdown took {exited:.1f} s"
