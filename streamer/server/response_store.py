"""Stored responses: /v1/responses' `store` (on unless a body says false), `previous_response_id`,
and GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items.

In this server's memory, lost on restart, at most --responses-store-mb of it: the least recently
used turns go first (a continued or fetched turn counts as used, and so do the turns before it).
A stored turn keeps the response object as its client got it, the input items its request sent
(each given an id) and the id of the response it continued. A request with previous_response_id
runs with the items of every turn of that chain, oldest first, inputs then outputs, before its own
input: the conversation so far. Instructions are not carried over: each request gives its own, as
in OpenAI's API. A response belongs to the API key that made it (its hash, guard.KEY_ID; none
without --api-key): to another key it does not exist.

A background response (`background: true`) runs in a task of its own: stored as queued at once,
read live while it runs (`running`), stored again when it ends (completed, incomplete, failed or
cancelled: POST /v1/responses/{id}/cancel, or the server shutting down).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec

from streamer.server.protocol import ApiError

ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
"""The id prefix of an input item of each type (OpenAI's), for items a request sent without one."""


@dataclass(frozen=True, slots=True)
class Turn:
    response: dict[str, Any]
    """The response object, as its client got it (its output items: the turn's outputs)."""
    inputs: list[dict[str, Any]]
    """The input items the request sent (a string input as one user message), each with an id."""
    previous: str | None
    """The response this one continued (previous_response_id)."""
    size: int
    """Bytes of the turn as JSON: what it counts against the store's budget."""

    @classmethod
    def of(cls, response: dict[str, Any], inputs: list[dict[str, Any]], previous: str | None) -> Turn:
        return cls(response, inputs, previous, len(msgspec.json.encode([response, inputs])))


class ResponseStore:
    """Turns by (owner, response id), least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._turns: OrderedDict[tuple[str, str], Turn] = OrderedDict()
        self._running: dict[tuple[str, str], tuple[asyncio.Task, Callable[[], Any]]] = {}
        """Background responses still running: their task and their response now."""

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._turns)

    def put(self, owner: str, turn: Turn) -> None:
        """Keep a turn, then drop the least recently used until the store fits its budget (a turn
        larger than the whole budget is not kept, and drops nothing)."""
        key = (owner, turn.response["id"])
        if (old := self._turns.pop(key, None)) is not None:
            self.bytes -= old.size
        if turn.size > self.max_bytes:
            return
        self._turns[key] = turn
        self.bytes += turn.size
        while self.bytes > self.max_bytes and self._turns:
            _, dropped = self._turns.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, owner: str, response_id: str, param: str | None = None) -> Turn:
        """The turn, marked used; 404 where there is none (never stored, dropped, or another key's)."""
        turn = self._turns.get((owner, response_id))
        if turn is None:
            why = " (responses are kept in this server's memory, least recently used dropped first)" \
                if self.enabled else " (this server stores no responses: --responses-store-mb 0)"
            raise ApiError(f"no response with id {response_id!r} is stored{why}", 404, param=param,
                           code="response_not_found")
        self._turns.move_to_end((owner, response_id))
        return turn

    def delete(self, owner: str, response_id: str) -> None:
        turn = self.get(owner, response_id)
        del self._turns[(owner, response_id)]
        self.bytes -= turn.size

    def history(self, owner: str, response_id: str, param: str = "previous_response_id") -> list[dict[str, Any]]:
        """The items of the chain that ends with this response, oldest turn first: each turn's
        inputs, then its outputs. Every turn of it must still be stored (404 naming the first
        missing one), and ended (400 while it runs in the background)."""
        if (owner, response_id) in self._running:
            raise ApiError(f"response {response_id!r} is still running in the background: continue it once it "
                           "ended (GET /v1/responses/{id} tells its status)", param=param)
        turns = []
        rid: str | None = response_id
        while rid is not None:
            turns.append(self.get(owner, rid, param))
            rid = turns[-1].previous
        return [item for turn in reversed(turns) for item in (*turn.inputs, *turn.response["output"])]

    def input_items(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        """What the response's request ran with, instructions apart: the earlier turns' items and
        its own inputs."""
        turn = self.get(owner, response_id)
        earlier = self.history(owner, turn.previous) if turn.previous is not None else []
        return [*earlier, *turn.inputs]


    # ---- background responses

    def run(self, owner: str, response_id: str, work: Coroutine[Any, Any, None], now: Callable[[], Any]) -> None:
        """Run a background response's work in a task of its own (it stores the response when it
        ends); `now` gives the response as it stands meanwhile."""
        key = (owner, response_id)
        task = asyncio.get_running_loop().create_task(work, name=f"streamer-response-{response_id}")
        self._running[key] = (task, now)
        task.add_done_callback(lambda _: self._running.pop(key, None))

    def running(self, owner: str, response_id: str) -> Any | None:
        """A background response's object as it stands now (None: it is not running)."""
        entry = self._running.get((owner, response_id))
        return entry[1]() if entry is not None else None

    async def cancel(self, owner: str, response_id: str) -> None:
        """Cancel a running background response and wait until it stored itself (nothing if it
        is not running)."""
        entry = self._running.get((owner, response_id))
        if entry is not None:
            entry[0].cancel()
            await asyncio.wait([entry[0]])

    async def cancel_all(self) -> None:
        """The server stopping: every background response cancelled (each stores itself so)."""
        tasks = [task for task, _ in self._running.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def as_stored(items: list[dict[str, Any]], new_id: Any) -> list[dict[str, Any]]:
    """Input items as OpenAI's API lists them: each with a type (a message's may go without), a
    message's text content as one text part, and an id (new_id(prefix) where it had none)."""
    out = []
    for item in items:
        item = {"type": "message", **item} if not item.get("type") else dict(item)
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        out.append(item if item.get("id") else {"id": new_id(ITEM_PREFIXES.get(item["type"], "item")), **item})
    return out


def page(items: list[dict[str, Any]], order: str, limit: int, after: str | None) -> dict[str, Any]:
    """A list page of items (OpenAI's cursor list): in `order` (asc: oldest first), `limit` of them
    after the item with id `after` (400 when no item has that id)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ApiError(f"after: no input item of this response has id {after!r}", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}
