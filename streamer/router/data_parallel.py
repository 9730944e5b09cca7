"""DataParallelEngine: N engine replicas behind the one Engine interface (engine/protocol.py).

Each replica is an EngineProcess with the same EngineConfig (so a replica that is itself
tensor-parallel is just that EngineProcess), started with its own devices
(router/devices.py). The server holds one DataParallelEngine as it would hold one engine;
each submit() is routed by a RoutingPolicy (router/policy.py) on the request's routing key
(router/keys.py), and a WebSocket session's turns go where its first turn went.

  Inbox:  submit / abort / stop from the server; each replica's outputs through its own
          submit() iterator.
  Outbox: a request to exactly one replica; an abort to the replica that holds the request.
  State:  request id -> replica, for the requests open now (abort looks it up; an id it does
          not hold is a no-op, as for one engine); the policy's trees and load counts.

Failure: a replica that dies ends its own requests (EngineProcess does: ENGINE_DOWN) and is
routed no more; the others go on serving, and /health says which one is down (status()).
The engine counts as dead only once every replica is, and as stalled while every replica
still alive is stalled (then no replica could take a request).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator
from typing import Any

from streamer.config import EngineConfig
from streamer.engine.outputs import engine_failed
from streamer.engine.protocol import Engine, ModelInfo
from streamer.engine.remote import EngineProcess
from streamer.engine_stats import EngineStats
from streamer.messages import GenerateRequest, RequestOutput
from streamer.router.devices import replica_environments
from streamer.router.keys import request_key, session_of
from streamer.router.metrics import RouterCollector
from streamer.router.policy import DEFAULT_MARGIN, NoReplica, RoutingPolicy
from streamer.router.stats import total_stats


class DataParallelEngine:
    def __init__(self, config: EngineConfig, size: int, margin: int = DEFAULT_MARGIN) -> None:
        environments = replica_environments(config, size)  # (refused here: too few devices)
        self.config = config
        self.replicas = [EngineProcess(config) for _ in range(size)]
        for replica, env in zip(self.replicas, environments):
            replica.env = env
        self.policy = RoutingPolicy(size, margin)
        self.model_name = self.replicas[0].model_name
        self._where: dict[str, int] = {}
        self._counter = 0
        self._launched = False
        self._sent = [0] * size
        """Requests routed to each replica, all time (/metrics)."""

    # ---- lifecycle ----------------------------------------------------------------------

    def launch(self) -> None:
        """Start every replica at once (each loads its model in its own process) and wait for
        all; if one fails, stop those that started and raise its error."""
        # each launch loads the tokenizer once its replica is ready: transformers' lazy module
        # is not safe to import from two threads at once (an ImportError), so import it here
        from transformers import AutoTokenizer  # noqa: F401, PLC0415

        errors: list[BaseException | None] = [None] * len(self.replicas)

        def one(i: int) -> None:
            try:
                self.replicas[i].launch()
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors[i] = e

        threads = [threading.Thread(target=one, args=(i,), name=f"streamer-replica-{i}")
                   for i in range(len(self.replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [e for e in errors if e is not None]
        if failed:
            asyncio.run(self._stop_all())
            raise failed[0]
        self._launched = True

    async def start(self) -> None:
        if not self._launched:
            await asyncio.to_thread(self.launch)
        await asyncio.gather(*(r.start() for r in self.replicas))

    async def stop(self) -> None:
        await self._stop_all()

    async def _stop_all(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas))

    # ---- the Engine interface -----------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self.replicas[0].info  # (every replica serves the same model)

    @property
    def dead(self) -> str | None:
        reasons = [r.dead for r in self.replicas]
        if all(reasons):
            return "every replica is down: " + "; ".join(f"replica {i}: {d}" for i, d in enumerate(reasons))
        return None

    @property
    def stalled(self) -> str | None:
        alive = [(i, r.stalled) for i, r in enumerate(self.replicas) if not r.dead]
        if alive and all(s for _, s in alive):
            return "; ".join(f"replica {i}: {s}" for i, s in alive)
        return None

    def new_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Every replica loads it; where one fails (a folder they all refuse fails on all), those that
        loaded a new name unload it again, and the first error is raised."""
        results = await asyncio.gather(*(r.load_lora(name, path, replace) for r in self.replicas),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            if not replace:
                await asyncio.gather(*(r.unload_lora(name) for r, e in zip(self.replicas, results)
                                       if not isinstance(e, BaseException)), return_exceptions=True)
            raise errors[0]

    async def unload_lora(self, name: str) -> None:
        """Every replica unloads it (the first error, if any, is raised after all have tried)."""
        results = await asyncio.gather(*(r.unload_lora(name) for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    def usable(self) -> list[bool]:
        return [not r.dead and not r.stalled for r in self.replicas]

    def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        return self._follow(request)

    async def _follow(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        rid = request.request_id
        try:
            i = self.policy.route(request_key(request), session_of(rid), self.usable())
        except NoReplica:
            yield engine_failed(rid, self.dead or self.stalled or "no replica is available")
            return
        self.policy.open(i)
        self._sent[i] += 1
        self._where[rid] = i
        try:
            async with contextlib.aclosing(self.replicas[i].submit(request)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self.policy.close(i)
            if self._where.get(rid) == i:
                del self._where[rid]

    def abort(self, request_id: str) -> None:
        i = self._where.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    def replica_of(self, request_id: str) -> int | None:
        """The replica that holds an open request (None: none does)."""
        return self._where.get(request_id)

    def stats(self) -> EngineStats:
        return total_stats(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def collector(self) -> RouterCollector:
        """The routing metrics (the server's /metrics registers it beside the replicas' engine metrics)."""
        return RouterCollector(self.policy, "replica", [str(i) for i in range(len(self.replicas))], self.usable,
                               lambda: list(self._sent))

    def replica_status(self) -> list[dict[str, Any]]:
        """Each replica's state, for /health: ok, stalled or down, with the reason."""
        out = []
        for i, r in enumerate(self.replicas):
            state, why = ("down", r.dead) if r.dead else ("stalled", r.stalled) if r.stalled else ("ok", None)
            entry: dict[str, Any] = {"replica": i, "status": state, "open_requests": self.policy.load[i]}
            if why:
                entry["error"] = why
            out.append(entry)
        return out

    async def generate(self, request: GenerateRequest) -> RequestOutput:
        from streamer.engine.outputs import collect  # noqa: PLC0415

        return await collect(request.request_id, self.submit(request))


def _typed(engine: DataParallelEngine) -> Engine:
    return engine  # (mypy: it implements the interface the server depends on)
