"""The `streamer serve` hosts behind a standalone router, and whether each one is up.

A worker is up while its /health answers 200 ("ok", or "degraded": some of its own replicas
are down, the rest serve). It is checked every CHECK_INTERVAL_S, and marked down at once
when a connection to it fails; a worker that is down is routed nothing until a check finds
it up again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from streamer.errors import ConfigError
from streamer.router.policy import RoutingPolicy

log = logging.getLogger("streamer.router")

CHECK_INTERVAL_S = 2.0
CHECK_TIMEOUT_S = 5.0


@dataclass
class Worker:
    url: str
    up: bool = False
    error: str | None = "not checked yet"
    requests: int = 0
    """Requests (and WebSocket sessions) routed to it, all time."""

    def mark_down(self, error: str) -> None:
        if self.up:
            log.warning("worker %s is down: %s", self.url, error)
        self.up, self.error = False, error


def worker_urls(urls: Sequence[str]) -> list[str]:
    out = []
    for url in urls:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--worker {url!r}: give the URL of a `streamer serve` host, e.g. http://10.0.0.2:8000")
        if url in out:
            raise ConfigError(f"--worker {url} is given twice")
        out.append(url)
    if not out:
        raise ConfigError("streamer router needs at least one --worker URL")
    return out


class WorkerPool:
    def __init__(self, urls: Sequence[str], policy: RoutingPolicy) -> None:
        self.workers = [Worker(u) for u in urls]
        self.policy = policy

    def usable(self) -> list[bool]:
        return [w.up for w in self.workers]

    async def check(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._check(client, w) for w in self.workers))

    async def _check(self, client: httpx.AsyncClient, w: Worker) -> None:
        try:
            r = await client.get(f"{w.url}/health", timeout=CHECK_TIMEOUT_S)
        except httpx.HTTPError as e:
            w.mark_down(f"/health: {type(e).__name__}: {e}")
            return
        if r.status_code == 200:
            if not w.up:
                log.info("worker %s is up", w.url)
            w.up, w.error = True, None
        else:
            w.mark_down(f"/health answered {r.status_code}: {r.text[:200]}")

    async def watch(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check(client)

    def status(self) -> list[dict[str, Any]]:
        out = []
        for i, w in enumerate(self.workers):
            entry: dict[str, Any] = {"worker": w.url, "status": "ok" if w.up else "down",
                                     "open_requests": self.policy.load[i]}
            if w.error:
                entry["error"] = w.error
            out.append(entry)
        return out
