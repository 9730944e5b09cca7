"""Node: one edge of the radix tree (radix.py), and where its pages live."""

from __future__ import annotations

from typing import Any


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "host", "loading", "pin")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None) -> None:
        self.key = key
        self.pages = pages
        """Device pages of the edge ([] where the node is on the host only)."""
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.host: list[int] | None = None
        """Host pages of the edge (a copy in the host tier), or None."""
        self.loading: Any = None
        """The event of the copy filling `pages` from `host` (CUDA), until it has completed."""
        self.pin = 0

    @property
    def ready(self) -> bool:
        """Its device pages hold the edge's KV now (a finished load is noticed here)."""
        if self.loading is not None and self.loading.query():
            self.loading = None
        return bool(self.pages) and self.loading is None
