"""PrefixTree: an approximate picture of what one replica's radix cache holds.

The router cannot see a replica's RadixCache (it lives in another process, or on another
host), so it keeps, per replica, a radix tree of the routing keys (router/keys.py: the
prompt's text, or its token ids as characters) it sent there. The picture is approximate
on purpose: the replica may have evicted a prefix the tree still holds, and the tree is
cut at characters, not at pages. It only has to rank the replicas by their likely hit.

  match(key) -> the length of the longest prefix of key on a path of the tree.
  insert(key): add key's path; every node on it becomes the most recently used.
  size: characters on all edges, kept at most max_chars: when an insert passes it, the
      least recently used leaves are dropped until the tree is back under LOW_WATER of it
      (so a prune drops many leaves at once, and inserts stay amortized O(key)).

Invariant: a node's children differ in their edge's first character; no edge is empty
(only the root's).
"""

from __future__ import annotations

import heapq
import itertools

LOW_WATER = 0.9


class _Node:
    __slots__ = ("edge", "children", "parent", "last")

    def __init__(self, edge: str, parent: _Node | None, last: int) -> None:
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last = last


def _common(a: str, b: str) -> int:
    """Length of the common prefix of a and b: slice comparisons (C speed), bisected."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    def __init__(self, max_chars: int = 1 << 22) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, not {max_chars}")
        self.max_chars = max_chars
        self.root = _Node("", None, 0)
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, key: str) -> int:
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.edge, key[pos : pos + len(child.edge)])
            pos += n
            if n < len(child.edge):
                break
            node = child
        return pos

    def insert(self, key: str) -> None:
        now = next(self._clock)
        node, pos = self.root, 0
        node.last = now
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, now)
                self.size += len(key) - pos
                break
            n = _common(child.edge, key[pos : pos + len(child.edge)])
            if n < len(child.edge):  # split child's edge at n: a new inner node takes its head
                inner = _Node(child.edge[:n], node, now)
                node.children[key[pos]] = inner
                child.edge, child.parent = child.edge[n:], inner
                inner.children[child.edge[0]] = child
                child = inner
            child.last = now
            node, pos = child, pos + n
        if self.size > self.max_chars:
            self._prune(int(self.max_chars * LOW_WATER))

    def _prune(self, target: int) -> None:
        """Drop least recently used leaves until size <= target (a parent left childless
        becomes a leaf in its turn, with its own last use)."""
        heap = [(n.last, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while heap and self.size > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
