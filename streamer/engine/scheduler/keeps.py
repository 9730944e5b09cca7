"""Keeps: prefixes pinned in the radix tree on behalf of a key (a WebSocket session).

A request with SamplingParams.keep_prefix leaves its tokens' path pinned (RadixCache.pin)
under that key, replacing the key's previous path (the previous turn's history is a
prefix of this one's, so the pin moves down the same path). A pinned path may leave the
device (it is written back to the host tier), but the host tier's LRU never drops it, so
the session's next turn, however long after, is a host hit rather than a recompute. The
pin ends with abort(key) (the session closed) or keep_prefix_s after the request left.

Without a host tier a pin changes nothing: device eviction ignores pins (a session never
holds device pages it does not use).
"""

from __future__ import annotations

import time

from streamer.engine.request import Request
from streamer.kv.radix import Node, RadixCache


class Keeps:
    def __init__(self, tree: RadixCache) -> None:
        self.tree = tree
        self.kept: dict[str, tuple[Node, float]] = {}
        """key -> (pinned node, time.monotonic() at which the pin ends)."""

    def keep(self, req: Request, node: Node) -> None:
        key = req.params.keep_prefix
        if key is None or not node.key:
            return
        self.tree.pin(node)
        self.release(key)
        self.kept[key] = (node, time.monotonic() + req.params.keep_prefix_s)

    def release(self, key: str) -> bool:
        """End key's pin (False: it has none)."""
        old = self.kept.pop(key, None)
        if old is None:
            return False
        self.tree.unpin(old[0])
        return True

    def expire(self, now: float) -> None:
        for key in [k for k, (_, until) in self.kept.items() if until <= now]:
            self.release(key)

    def next(self) -> float | None:
        """When the earliest pin ends (None: none)."""
        return min((until for _, until in self.kept.values()), default=None)
