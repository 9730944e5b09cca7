"""RoutingPolicy: which replica (an engine process, or a `streamer serve` host) serves a request.

Cache-aware with a load bound, as SGLang's router does:

  1. a request of a session (a WebSocket conversation) goes where its session went, while
     that replica is usable (its turns share the conversation as prefix, and the replica's
     radix cache holds it);
  2. else the replica whose PrefixTree holds the longest prefix of the request's routing key,
     when that prefix is at least min_match of the key (a shorter one is a chat template's
     or a system prompt's head that every replica has seen) and that replica's open
     requests exceed the least loaded usable replica's by at most `margin`;
  3. else the least loaded usable replica; ties go to the one with the smallest tree (the
     least cached: a new prefix goes where it displaces least), then the lowest index.

The key is inserted into the chosen replica's tree. Load is the router's own count of
requests it sent and that have not ended (open()/close() around each): exact and up to
date at every decision, which the replicas' periodic stats are not.

Invariant: a replica that is not usable (dead, stalled, a worker that is down) is never
chosen; with none usable, route() raises NoReplica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamer.config import BALANCE_MARGIN
from streamer.errors import ConfigError
from streamer.router.tree import PrefixTree

DEFAULT_MARGIN = BALANCE_MARGIN
"""(ServerConfig.balance_margin, `--balance-margin`) Open requests by which the replica holding a prompt's prefix may exceed the least loaded
one and still get it. A cache hit saves its prefix's prefill, but a replica with 8 more
requests in its batch decodes each of them slower: past the margin, balance wins (SGLang
defaults to 32 for GPU servers of large batches; 8 keeps a DP=2 pair of small batches even)."""
DEFAULT_MIN_MATCH = 0.5
"""The share of the key a replica's matched prefix must cover to count as a hit."""
MAX_SESSIONS = 65536
"""Session -> replica entries kept (least recently routed dropped first)."""


class NoReplica(RuntimeError):
    """No replica can take a request (all dead, stalled or down)."""


@dataclass
class Decisions:
    """How many requests each rule routed (the router's /metrics)."""

    session: int = 0
    prefix: int = 0
    balance: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"session": self.session, "prefix": self.prefix, "balance": self.balance}


@dataclass
class RoutingPolicy:
    size: int
    margin: int = DEFAULT_MARGIN
    min_match: float = DEFAULT_MIN_MATCH
    tree_chars: int = 1 << 22
    """Characters each replica's PrefixTree keeps (LRU-pruned): 4 Mi characters, about
    1 M tokens of prompts, tens of MB of Python objects per replica."""
    trees: list[PrefixTree] = field(init=False)
    load: list[int] = field(init=False)
    decisions: Decisions = field(init=False, default_factory=Decisions)
    max_spread: int = field(init=False, default=0)
    """The largest (chosen replica's load - least loaded's) seen at a decision, rule 2 or 3."""
    _sessions: OrderedDict[str, int] = field(init=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"a router needs at least one replica, not {self.size}")
        if self.margin < 0:
            raise ConfigError(f"the balance margin (--balance-margin) must be >= 0, not {self.margin}")
        if not 0.0 <= self.min_match <= 1.0:
            raise ConfigError(f"min_match must be in [0, 1], not {self.min_match}")
        self.trees = [PrefixTree(self.tree_chars) for _ in range(self.size)]
        self.load = [0] * self.size

    def route(self, key: str, session: str | None = None, usable: Sequence[bool] | None = None) -> int:
        """The replica for a request (see the module's rules); its key joins that replica's tree.
        The caller calls open(i) when it sends the request and close(i) when it ends."""
        ok = [i for i in range(self.size) if usable is None or usable[i]]
        if not ok:
            raise NoReplica("no replica is available")
        if session is not None:
            i = self._sessions.get(session)
            if i is not None and i in ok:
                self._sessions.move_to_end(session)
                self.decisions.session += 1
                self.trees[i].insert(key)
                return i
        least = min(self.load[i] for i in ok)
        best, best_len = -1, 0
        for i in ok:
            n = self.trees[i].match(key)
            if n > best_len or (n == best_len and best >= 0 and self.load[i] < self.load[best]):
                best, best_len = i, n
        if best >= 0 and best_len > 0 and best_len >= self.min_match * len(key) \
                and self.load[best] - least <= self.margin:
            choice = best
            self.decisions.prefix += 1
        else:
            choice = min(ok, key=lambda i: (self.load[i], self.trees[i].size, i))
            self.decisions.balance += 1
        self.max_spread = max(self.max_spread, self.load[choice] - least)
        self.trees[choice].insert(key)
        if session is not None:
            self._sessions[session] = choice
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return choice

    def open(self, i: int) -> None:
        self.load[i] += 1

    def close(self, i: int) -> None:
        self.load[i] -= 1

    def session_replica(self, session: str) -> int | None:
        return self._sessions.get(session)

    def forget_session(self, session: str) -> None:
        self._sessions.pop(session, None)
