"""Starting the ranks of a tensor-parallel engine, and watching them.

  start_ranks  in the engine's process (rank 0, node 0): checks the model and devices,
               opens the rendezvous (a torch.distributed TCPStore), starts this node's other
               ranks (worker.py, each a fresh interpreter: spawned, never forked), joins the
               group, and returns rank 0's runner (runner.TPRunner).
  run_node     `streamer serve --node-rank K` (K > 0): starts node K's ranks and waits.

Rendezvous: one node, a free port on 127.0.0.1 (engines side by side never collide);
several nodes (--nnodes), MASTER_ADDR:MASTER_PORT, where node 0's engine listens. Rank r
runs on node r // (size // nnodes), on device base + r % (size // nnodes).

Failure: a thread per local rank waits for its process; an exit before close() is a dead
rank: the others are terminated and the engine is told (TPRunner.fail), which ends its
open requests with an error and marks it dead (/health 503). A rank that fails to start
writes its error into the store (error/<rank>), which start_ranks raises. Ranks on other
nodes are not children: their death shows as a failed collective (gloo: at once; NCCL:
after COLLECTIVE_TIMEOUT_S, when NCCL's watchdog ends the process).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch.distributed as dist

from streamer.config import EngineConfig
from streamer.distributed.checks import check_devices, check_model, rank_device
from streamer.env import rendezvous_env
from streamer.errors import ConfigError, ModelLoadError

log = logging.getLogger("streamer.distributed")

START_TIMEOUT_S = 900.0
"""How long ranks may take to join (every rank loads its shard meanwhile)."""
STOP_TIMEOUT_S = 10.0


def rendezvous(config: EngineConfig) -> tuple[str, int]:
    if config.nnodes == 1:
        return "127.0.0.1", 0
    addr, port = rendezvous_env()
    if not addr or port is None:
        raise ConfigError(f"--nnodes {config.nnodes}: set MASTER_ADDR and MASTER_PORT (node 0's address and a "
                          "free port there) on every node")
    return addr, port


class Workers:
    """This node's rank processes other than the engine's own."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store
        self.procs: dict[int, subprocess.Popen] = {}
        self.closing = False
        self._on_death: Callable[[str], None] | None = None
        self._dead: dict[int, int] = {}
        """rank -> exit code, of the ranks that exited before close()."""

    def spawn(self, config: EngineConfig, model_path: Path, ranks: Iterable[int], addr: str, port: int) -> None:
        per_node = config.tensor_parallel_size // config.nnodes
        for rank in ranks:
            args = dict(config=msgspec.to_builtins(config), model_path=str(model_path), rank=rank,
                        local_rank=rank % per_node, addr=addr, port=port)
            # (the parent's sys.path: a rank imports the same streamer, wherever it was started)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "streamer.distributed.worker", json.dumps(args)],
                                                env=env)
            threading.Thread(target=self._wait, args=(rank,), name=f"streamer-tp-watch-{rank}", daemon=True).start()

    def _wait(self, rank: int) -> None:
        code = self.procs[rank].wait()
        if self.closing:
            return
        self._dead[rank] = code
        if self._on_death is not None:
            self._on_death(self.why(f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) exited "
                                    f"with code {code}"))

    def watch(self, on_death: Callable[[str], None]) -> None:
        self._on_death = on_death
        for rank, code in list(self._dead.items()):
            on_death(self.why(f"tensor-parallel rank {rank} exited with code {code}"))

    def errors(self) -> dict[int, str]:
        """What ranks that failed wrote into the store (error/<rank>)."""
        out = {}
        for rank in self.procs:
            key = f"error/{rank}"
            try:
                if self.store.check([key]):
                    out[rank] = self.store.get(key).decode()
            except Exception:  # noqa: BLE001 - the store itself is gone
                break
        return out

    def exited(self, wait_s: float = 0.0) -> str:
        """The local ranks that have exited (waiting up to wait_s for one to show: a failed
        collective can come a moment before its peer's exit is seen), as text."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            if gone or time.monotonic() >= deadline:
                return ", ".join(f"tensor-parallel rank {r} exited with code {c}" for r, c in sorted(gone.items()))
            time.sleep(0.02)

    def why(self, what: str) -> str:
        if not self.closing and "exited" not in what:
            gone = self.exited(wait_s=1.0)
            if gone:
                what = f"{gone} ({what})"
        errors = self.errors()
        if not errors:
            return what
        return what + "; " + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))

    def await_joined(self, ranks: Iterable[int]) -> None:
        keys = [f"joined/{r}" for r in ranks]
        deadline = time.monotonic() + START_TIMEOUT_S
        while keys and not self.store.check(keys):
            for rank, p in self.procs.items():
                if p.poll() is not None:
                    raise ConfigError(self.why(f"tensor-parallel rank {rank} exited at start (code {p.returncode})"))
            if time.monotonic() > deadline:
                raise ConfigError(f"tensor-parallel ranks did not join within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def terminate(self) -> None:
        self.closing = True
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        self._reap(STOP_TIMEOUT_S)

    def close(self) -> None:
        """After RankStop: wait for the ranks to exit, terminate the ones that do not."""
        self.closing = True
        self._reap(STOP_TIMEOUT_S)

    def _reap(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _store(addr: str, port: int, master: bool) -> dist.TCPStore:
    return dist.TCPStore(addr, port, is_master=master, timeout=timedelta(seconds=START_TIMEOUT_S),
                         wait_for_workers=False)


def _load_error(text: str) -> Exception:
    kind, _, message = text.partition(": ")
    return ModelLoadError(message) if kind == "ModelLoadError" else ConfigError(text)


def start_ranks(config: EngineConfig, model_path: Path, diagnostics: Any) -> Any:
    """Rank 0's runner (runner.TPRunner), the group joined and every local rank started."""
    import weakref

    from streamer.distributed.runner import TPRunner
    from streamer.model.loader import load_hf_config
    from streamer.model.tp_group import building, init, leave

    check_model(config, load_hf_config(model_path), model_path)
    check_devices(config)
    size, per_node = config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes
    addr, port = rendezvous(config)
    store = _store(addr, port, master=True)
    workers = Workers(store)
    try:
        workers.spawn(config, model_path, range(1, per_node), addr, store.port)
        workers.await_joined(range(1, size))
        group = init(0, size, 0, rank_device(config, 0), store)
        with building(group):
            runner = TPRunner(config, str(model_path), diagnostics, group, workers)
    except BaseException as e:
        errors = workers.errors()
        workers.terminate()
        leave()
        if errors:
            rank, text = min(errors.items())
            err = _load_error(text)
            raise type(err)(f"tensor-parallel rank {rank}: {err}") from None
        if isinstance(e, RuntimeError):  # a collective failed: a rank went away meanwhile
            raise ConfigError(f"tensor-parallel start failed: {e}") from None
        raise
    weakref.finalize(runner, workers.terminate)  # (an engine never stopped: at exit)
    return runner


def run_node(config: EngineConfig, model_path: Path) -> None:
    """Node node_rank > 0 of a multi-node engine: its ranks, until they end. (model_path from
    the caller: importing the engine here would make distributed <-> engine a cycle.)"""
    from streamer.model.loader import load_hf_config

    check_model(config, load_hf_config(model_path), model_path)
    check_devices(config)
    per_node = config.tensor_parallel_size // config.nnodes
    addr, port = rendezvous(config)
    workers = Workers(_store(addr, port, master=False))
    first = config.node_rank * per_node
    workers.spawn(config, model_path, range(first, first + per_node), addr, port)
    log.info("node %d: ranks %d-%d started", config.node_rank, first, first + per_node - 1)
    try:
        for p in workers.procs.values():
            p.wait()
    finally:
        workers.terminate()
    codes = {r: p.returncode for r, p in workers.procs.items() if p.returncode}
    if codes:
        raise ConfigError(workers.why(f"node {config.node_rank}: rank(s) exited with {codes}"))
