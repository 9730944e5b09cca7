"""`streamer serve` as a user runs it: flags, API key, a full queue, and a graceful SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from streamer.cli import build_parser

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_FLAGS = ["--host", "--port", "--api-key", "--served-model-name", "--max-queue", "--session-idle-timeout"]


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]



def test_a_server_module_that_cannot_be_imported_is_named_not_its_flags(monkeypatch, capsys):
    """A broken install (a dependency of the server missing) says which import failed; it does not
    report the server's own flags (--port ...) as unrecognized arguments."""
    import builtins

    from streamer import cli

    real_import = builtins.__import__

    def no_server(name, *args, **kwargs):
        if name == "streamer.server.serve":
            raise ImportError("No module named 'uvicorn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_server)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", "m", "--port", "8100"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cannot run `streamer serve`" in err and "uvicorn" in err
    assert "unrecognized arguments" not in err

def test_every_serve_flag_has_help():
    p = serve_parser()
    flags = {s for a in p._actions for s in a.option_strings}
    assert set(SERVER_FLAGS) <= flags and "--model" in flags
    undocumented = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert not undocumented
    text = p.format_help()
    assert all(f in text for f in SERVER_FLAGS)
    assert p.parse_args([]).host == "127.0.0.1"  # loopback unless asked


def test_engine_flags_reach_the_engine_config():
    from streamer.cli import engine_config

    args = serve_parser().parse_args(["--max-num-seqs", "8", "--cuda-graph-max-tokens", "0", "--no-prefix-caching",
                                      "--hold-ahead-ms", "0", "--no-decode-gemv", "--kv-cache-dtype", "fp8",
                                      "--cuda-graph-max-bs", "128", "--quantization", "fp8"])
    cfg = engine_config(args)
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_tokens, cfg.enable_prefix_caching) == (8, 0, False)
    assert (cfg.hold_ahead_ms, cfg.decode_gemv, cfg.kv_cache_dtype) == (0.0, False, "fp8")
    assert (cfg.cuda_graph_max_bs, cfg.quantization) == (128, "fp8")
    default = engine_config(serve_parser().parse_args([]))
    assert (default.cuda_graph_max_tokens, default.hold_ahead_ms, default.decode_gemv) == (2048, 1.5, True)
    assert (default.kv_cache_dtype, default.cuda_graph_max_bs, default.quantization) == ("auto", 512, None)
    # a checkpoint format's name, as vLLM users pass it (checked against the checkpoint at load)
    assert engine_config(serve_parser().parse_args(["--quantization", "awq_marlin"])).quantization == "awq_marlin"
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--quantization", "int8"])


def test_the_engine_gets_its_own_process_on_cuda_unless_told():
    from streamer.config import EngineConfig, ServerConfig
    from streamer.server.serve import wants_engine_process

    def wants(flags, device):
        args = serve_parser().parse_args(flags)
        return wants_engine_process(ServerConfig(engine_process=args.engine_process, engine=EngineConfig(device=device)))

    assert wants([], "cuda") and wants([], "cuda:1") and not wants([], "cpu")
    assert wants(["--engine-process"], "cpu") and not wants(["--no-engine-process"], "cuda")
    assert wants([], "auto") == torch.cuda.is_available()


@pytest.fixture(scope="module")
def cli_server() -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "streamer", "serve", "--model", "default", "--port", str(port), "--api-key", KEY,
           "--served-model-name", "smol-cli", "--max-num-seqs", "1", "--max-queue", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("streamer serve did not start:\n" + "".join(lines))
        time.sleep(0.2)
    yield proc, url, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_startup_says_where_to_connect(cli_server):
    proc, url, lines = cli_server
    out = "".join(lines)
    assert f"{url}/" in out and f'base_url="{url}/v1"' in out and KEY not in out


def test_api_key(cli_server):
    _, url, _ = cli_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "smol-cli"
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
    ws_url = url.replace("http", "ws") + "/v1/chat/ws"
    with connect(ws_url) as ws, pytest.raises(ConnectionClosed) as e:
        ws.recv(timeout=10)
    assert e.value.rcvd.code == 1008
    with connect(f"{ws_url}?api_key={KEY}") as ws:
        assert json.loads(ws.recv(timeout=10))["model"] == "smol-cli"


def read_stream(url: str, body: dict, out: dict, key: str) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        out[key + "_status"] = r.status_code
        out[key] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out[key].append(line[6:])


def waiting(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("streamer_requests_waiting "):
            return float(line.split()[1])
    raise AssertionError("no streamer_requests_waiting metric")


def test_full_queue_then_graceful_sigterm(cli_server):
    """One runs, one waits (max_num_seqs 1, max_queue 1): a third gets 503; SIGTERM ends both streams cleanly."""
    proc, url, lines = cli_server
    body = {"prompt": "Tell me a story.", "max_tokens": 500, "ignore_eos": True, "stream": True}
    out: dict = {}
    a = threading.Thread(target=read_stream, args=(url, body, out, "a"))
    a.start()
    deadline = time.monotonic() + 30
    while len(out.get("a", [])) < 2:  # A runs
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b = threading.Thread(target=read_stream, args=(url, body, out, "b"))
    b.start()
    while waiting(url) < 1:  # B waits for the only running slot
        assert time.monotonic() < deadline
        time.sleep(0.05)

    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"

    proc.send_signal(signal.SIGTERM)
    a.join(30)
    b.join(30)
    # uvicorn re-raises the signal once it has shut down cleanly, so the exit status says SIGTERM
    assert proc.wait(30) in (0, -signal.SIGTERM)
    time.sleep(0.2)
    assert "Application shutdown complete" in "".join(lines)
    for key in ("a", "b"):
        events = out[key]
        assert out[key + "_status"] == 200 and events[-1] == "[DONE]", (key, events[-3:])
        finish = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-1])]
        assert finish[-1] == "abort" and finish.count("abort") == 1
    assert len(out["a"]) < 400  # aborted, not run to max_tokens
