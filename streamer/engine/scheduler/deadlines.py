"""Deadlines: SamplingParams.timeout.

Invariants:
  - a request with SamplingParams.timeout ends ("timeout") once its deadline has passed,
    wherever it is (queued, running, retrying): the actor loop wakes up for the earliest
    deadline even with no message (next), and the policy ends what is due (due);
  - an entry of a request that ended stays in the heap until popped: an entry is pending
    while the scheduler still holds its request with that very deadline.
"""

from __future__ import annotations

import heapq

from streamer.engine.request import Request
from streamer.messages import SamplingParams


class Deadlines:
    """A heap of (deadline, request id) over the scheduler's `requests` (shared, read only)."""

    def __init__(self, requests: dict[str, Request]) -> None:
        self.requests = requests
        self.heap: list[tuple[float, str]] = []

    def add(self, req: Request) -> None:
        if req.deadline is not None:
            heapq.heappush(self.heap, (req.deadline, req.request_id))

    def next(self) -> float | None:
        """The earliest deadline of a request still here."""
        heap = self.heap
        while heap and not self._pending(*heap[0]):
            heapq.heappop(heap)  # (its request ended before its deadline)
        if len(heap) > 4 * len(self.requests) + 1024:  # (ended ones deeper in the heap pile up)
            self.heap = heap = [e for e in heap if self._pending(*e)]
            heapq.heapify(heap)
        return heap[0][0] if heap else None

    def due(self, now: float) -> list[Request]:
        """Pop the requests whose deadline has passed."""
        out = []
        heap = self.heap
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            if self._pending(deadline, rid):
                out.append(self.requests[rid])
        return out

    def _pending(self, deadline: float, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and req.deadline == deadline


def timed_out(p: SamplingParams, where: str) -> str:
    return f"the request timed out: its deadline ({p.timeout:g} s) passed while it was {where}"
