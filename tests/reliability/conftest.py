"""Reliability tests: a real `python -m streamer serve` subprocess per test module.

Each module gets a server on a free loopback port (module-scoped fixture
`server`), with the extra command-line flags the module lists in SERVER_ARGS.
The fixture waits for /health. A module's server is kept for the next module
when that one asks for the same flags and the server is still up and healthy
(starting one costs several seconds of the 2-core CI machine); otherwise it is
stopped (SIGTERM, then a wait for the process) before the next one starts, so
that at most one runs at a time. A module that ends its server or reads its
whole log sets FRESH_SERVER = True: it gets a server of its own, stopped after
it. The server's output goes to a log file whose tail is shown when something fails.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
STARTUP_TIMEOUT = 180.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (labels kept verbatim; unlabelled names bare)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "streamer", "serve", "--model", "default", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """Resident bytes of the server process and of any children it started, each shared
        page counted once: the proportional set size (PSS), summed. (A sum of RSS would count
        twice the library pages that the grammar worker, a process of its own that imports
        xgrammar and so torch, shares with the server: ~130 MB of the default model's server.)"""
        p = psutil.Process(self.pid)
        return sum(q.memory_full_info().pss for q in [p, *p.children(recursive=True)])

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """/metrics once nothing runs or waits and every KV page is free or held by the prefix cache."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["streamer_requests_running"] == 0 and m["streamer_requests_waiting"] == 0
                    and m["streamer_kv_pages_used"] == m["streamer_kv_pages_cached"]):
                return m
            if time.monotonic() > deadline:
                keys = [k for k in m if k.startswith(("streamer_requests_", "streamer_kv_"))]
                raise AssertionError(f"not idle after {timeout} s: {({k: m[k] for k in keys})}")
            time.sleep(0.1)

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; SIGKILL if it hangs. Returns the exit status (negative: the signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def _healthy(srv: ServerProcess) -> bool:
    try:
        return srv.alive() and httpx.get(srv.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def _kept_servers() -> Iterator[dict[tuple[str, ...], ServerProcess]]:
    """The last module's server, by its flags, while the next module may want it (at most one)."""
    kept: dict[tuple[str, ...], ServerProcess] = {}
    yield kept
    for srv in kept.values():
        srv.terminate()


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           _kept_servers: dict[tuple[str, ...], ServerProcess]) -> Iterator[ServerProcess]:
    args = tuple(getattr(request.module, "SERVER_ARGS", []))
    fresh = getattr(request.module, "FRESH_SERVER", False)
    srv = None if fresh else _kept_servers.pop(args, None)
    for other in list(_kept_servers):
        _kept_servers.pop(other).terminate()
    if srv is not None and not _healthy(srv):
        srv.terminate()
        srv = None
    if srv is None:
        srv = ServerProcess(list(args), tmp_path_factory.mktemp("server") / "server.log")
        try:
            srv.wait_ready()
        except BaseException:
            srv.terminate()
            raise
    try:
        yield srv
    finally:
        if fresh or not srv.alive():
            srv.terminate()
        else:
            _kept_servers[args] = srv


@pytest.fixture(scope="session", autouse=True)
def _default_model_ready() -> None:
    """Fetch the default model once, before any server starts (each would otherwise race for it)."""
    from streamer.model.default_model import ensure_default_model

    ensure_default_model()
