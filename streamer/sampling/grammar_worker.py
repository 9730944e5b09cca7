"""Grammar compilation on trial, in a process of its own, under a time and a memory limit.

Why: xgrammar compiles in native code that nothing can interrupt. A JSON schema with
10,000 properties, or 100,000 choices, compiles for minutes and takes gigabytes; in a thread
of the engine it went on long after its request was refused, on every core. Here a spec the
engine has not seen is first compiled in a child process that is killed when it passes
either limit, so the refusal also stops the work. A spec that passed is compiled again in
the engine (the same input: the same time and memory, now known to be within the limits):
a compiled grammar cannot travel cheaply (serializing one of a 300-property schema took 2 s
and 20 MB against 39 ms to compile it).

  TrialCompiler(tokenizer_info, any_whitespace, timeout_s, memory_bytes, workers)
    .trial(kind, value)   blocks; RequestError when the spec is invalid or over a limit
    .close()

The grammar server (`python -m streamer.sampling.grammar_worker`, started on the first
trial) imports xgrammar once and forks one child per trial. It is single-threaded, so the
fork is safe, and a fork takes milliseconds where a fresh interpreter with xgrammar (and the
torch it imports) takes seconds. Its loop watches each child's resident memory and age and
kills it past a limit; at most `workers` children run at once, the other trials queue.

Frames on its stdin / stdout: a 4-byte little-endian length, then msgpack of _Init (once),
_Job; _Result back, one per _Job. EOF on stdin stops the server and its children.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import IO, Any

import msgspec

from streamer.errors import RequestError

log = logging.getLogger("streamer.grammar")

_LENGTH = struct.Struct("<I")
POLL_S = 0.02
"""How often the server checks its children's memory and age (at ~450 MB/s of growth, the
rate measured on a runaway compile, a child passes its limit by at most ~10 MB)."""
LOST = "the grammar compiler process exited; try again"
START_TIMEOUT_S = 60.0
"""How long a trial waits for the grammar server to start (it imports xgrammar and torch)."""


class _Init(msgspec.Struct, tag=True):
    tokenizer_info: str
    """xgrammar.TokenizerInfo.serialize_json()"""
    any_whitespace: bool
    timeout_s: float
    memory_bytes: int
    workers: int


class _Job(msgspec.Struct, tag=True):
    id: int
    kind: str
    value: str


class _Result(msgspec.Struct, tag=True):
    id: int
    error: str | None = None
    """None: compiled within the limits."""


_Frame = _Init | _Job | _Result


class CompilerUnavailable(RequestError):
    """The grammar server could not run the trial (it died, or did not start): says nothing
    about the spec, so it is not cached as the spec's error."""


def _write(out: IO[bytes], encoder: msgspec.msgpack.Encoder, msg: Any) -> None:
    data = encoder.encode(msg)
    out.write(_LENGTH.pack(len(data)) + data)
    out.flush()


def _read_exactly(src: IO[bytes], n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = src.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _read(src: IO[bytes], decoder: msgspec.msgpack.Decoder) -> Any:
    (n,) = _LENGTH.unpack(_read_exactly(src, _LENGTH.size))
    return decoder.decode(_read_exactly(src, n))


# ---- engine side ------------------------------------------------------------------------


class TrialCompiler:
    """The engine's handle on the grammar server (thread-safe; trials may run concurrently)."""

    def __init__(self, tokenizer_info: Any, *, any_whitespace: bool, timeout_s: float, memory_bytes: int,
                 workers: int) -> None:
        self.timeout_s = timeout_s
        self._init = _Init(tokenizer_info.serialize_json(), any_whitespace, timeout_s, memory_bytes, workers)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._futures: dict[int, Future] = {}
        self._ids = 0
        self._encoder = msgspec.msgpack.Encoder()

    def _ensure_started(self) -> subprocess.Popen:
        """The running grammar server (started, or restarted after it died). Under _lock."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        proc = subprocess.Popen([sys.executable, "-m", "streamer.sampling.grammar_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert proc.stdin is not None
        _write(proc.stdin, self._encoder, self._init)
        self._proc, self._futures = proc, {}  # (the trials of a server that died have failed)
        threading.Thread(target=self._read, args=(proc, self._futures), name="streamer-grammar-results",
                         daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen, futures: dict[int, Future]) -> None:
        decoder = msgspec.msgpack.Decoder(_Frame)
        assert proc.stdout is not None
        try:
            while True:
                res = _read(proc.stdout, decoder)
                with self._lock:
                    fut = futures.pop(res.id, None)
                if fut is not None:
                    fut.set_result(res.error)
        except (EOFError, OSError, msgspec.DecodeError):
            pass
        with self._lock:  # the server is gone: its trials fail (the next one restarts it)
            lost = list(futures.values())
            futures.clear()
        for f in lost:
            f.set_result(LOST)

    def start(self) -> None:
        """Start the grammar server now (in the background: this returns at once)."""

        def run() -> None:
            with self._lock:
                self._ensure_started()

        threading.Thread(target=run, name="streamer-grammar-start", daemon=True).start()

    def trial(self, kind: str, value: str) -> None:
        """Compile kind/value in the grammar server; RequestError if it is invalid or over a limit."""
        fut: Future = Future()
        with self._lock:
            proc = self._ensure_started()
            self._ids += 1
            job_id = self._ids
            self._futures[job_id] = fut
            try:
                assert proc.stdin is not None
                _write(proc.stdin, self._encoder, _Job(job_id, kind, value))
            except (BrokenPipeError, OSError):
                self._futures.pop(job_id, None)
                raise CompilerUnavailable("the grammar compiler is not available; try again") from None
        try:
            # the server enforces the time limit; this wait only covers its start and queue
            error = fut.result(timeout=START_TIMEOUT_S + 4 * self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._futures.pop(job_id, None)
            raise CompilerUnavailable("the grammar compiler did not answer; try again") from None
        if error == LOST:
            raise CompilerUnavailable(error)
        if error is not None:
            raise RequestError(error)

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()  # EOF: the server kills its children and exits
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


# ---- the grammar server -----------------------------------------------------------------


class _Child:
    __slots__ = ("pid", "job", "pipe", "started", "rss0")

    def __init__(self, pid: int, job: _Job, pipe: int, rss0: int) -> None:
        self.pid, self.job, self.pipe, self.started, self.rss0 = pid, job, pipe, time.monotonic(), rss0


def _rss(pid: int) -> int:
    """Resident bytes of a process (Linux /proc; 0 where unknown)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _compile_child(init: _Init, info: Any, job: _Job, pipe: int) -> None:
    """In the forked child: compile, report, exit (never returns)."""
    error: str | None = None
    try:
        import xgrammar as xgr

        from streamer.sampling.grammar_build import build, clean_error

        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            build(compiler, job.kind, job.value, init.any_whitespace)
        except RequestError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
            error = f"invalid {job.kind}: {clean_error(e)}"
    except BaseException as e:  # noqa: BLE001 - whatever happens, the child reports and exits
        error = f"the grammar compiler failed: {type(e).__name__}"
    data = msgspec.msgpack.encode(_Result(job.id, error))
    try:
        os.write(pipe, _LENGTH.pack(len(data)) + data)
    finally:
        os._exit(0)


def _serve() -> None:
    # frames go to the original stdout; anything printed (xgrammar's logs) goes to stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # unbuffered: the server selects on the descriptor, so no frame may wait in a buffer
    src = os.fdopen(sys.stdin.fileno(), "rb", buffering=0)
    decoder = msgspec.msgpack.Decoder(_Frame)
    encoder = msgspec.msgpack.Encoder()
    init = _read(src, decoder)
    assert isinstance(init, _Init)
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(init.tokenizer_info)
    sel = selectors.DefaultSelector()
    sel.register(src.fileno(), selectors.EVENT_READ, None)
    queue: deque[_Job] = deque()
    children: dict[int, _Child] = {}  # by pipe fd
    mb = init.memory_bytes >> 20

    def end(child: _Child, error: str | None, kill: bool) -> None:
        if kill:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(child.pid, 0)
        sel.unregister(child.pipe)
        os.close(child.pipe)
        del children[child.pipe]
        _write(out, encoder, _Result(child.job.id, error))

    while True:
        while queue and len(children) < init.workers:
            job = queue.popleft()
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _compile_child(init, info, job, w)
            os.close(w)
            children[r] = _Child(pid, job, r, _rss(pid))
            sel.register(r, selectors.EVENT_READ, children[r])
        for key, _ in sel.select(POLL_S):
            if key.data is None:  # a job from the engine, or EOF
                try:
                    msg = _read(src, decoder)
                except EOFError:
                    for child in list(children.values()):
                        end(child, "the grammar compiler stopped", kill=True)
                    return
                if isinstance(msg, _Job):
                    queue.append(msg)
                continue
            child = key.data
            head = os.read(child.pipe, 1 << 16)
            buf = head
            while len(buf) >= _LENGTH.size and len(buf) < _LENGTH.size + _LENGTH.unpack(buf[:4])[0]:
                more = os.read(child.pipe, 1 << 16)
                if not more:
                    break
                buf += more
            try:
                res = msgspec.msgpack.decode(buf[_LENGTH.size:], type=_Result)
                end(child, res.error, kill=False)
            except (msgspec.DecodeError, struct.error):  # died without a word (a crash)
                end(child, f"the grammar compiler crashed on this {child.job.kind}", kill=True)
        now = time.monotonic()
        for child in list(children.values()):
            if now - child.started > init.timeout_s:
                end(child, f"compiling the {child.job.kind} grammar took longer than {init.timeout_s:g} s "
                           "(the limit, --grammar-compile-timeout); simplify the schema or pattern", kill=True)
            elif _rss(child.pid) - child.rss0 > init.memory_bytes:
                end(child, f"compiling the {child.job.kind} grammar needed more than {mb} MB (the limit, "
                           "--grammar-compile-memory-mb); simplify the schema or pattern", kill=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _serve()
