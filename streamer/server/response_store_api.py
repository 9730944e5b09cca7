"""The endpoints of stored responses (response_store.py): GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel. A response is looked up
under the API key of the request (guard.KEY_ID): another key's is not found."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from streamer.server.guard import KEY_ID
from streamer.server.openai_api import json_response, server
from streamer.server.protocol import ApiError
from streamer.server.response_store import page


def query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    """The request's query parameters, any but `allowed` refused by name."""
    for name in request.query_params:
        if name not in allowed:
            raise ApiError(f"query parameter {name!r} is not supported here"
                           + (f" (only {', '.join(allowed)})" if allowed else ""), param=name)
    return dict(request.query_params)


async def stored_response(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response; DELETE: forget it."""
    store, owner, rid = server(request).responses, request.scope.get(KEY_ID, ""), request.path_params["response_id"]
    query(request, ())
    if request.method == "DELETE":
        await store.cancel(owner, rid)
        store.delete(owner, rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})
    running = store.running(owner, rid)
    return json_response(running if running is not None else store.get(owner, rid).response)


async def cancel(request: Request) -> Response:
    """POST /v1/responses/{id}/cancel: a background response stopped where it is (status
    cancelled, what was generated kept); one that already ended is returned as it is."""
    store, owner, rid = server(request).responses, request.scope.get(KEY_ID, ""), request.path_params["response_id"]
    query(request, ())
    response = store.get(owner, rid).response
    if not response.get("background"):
        raise ApiError(f"response {rid!r} did not run in the background: only background responses can be "
                       "cancelled", param="response_id")
    await store.cancel(owner, rid)
    return json_response(store.get(owner, rid).response)


async def input_items(request: Request) -> Response:
    """GET /v1/responses/{id}/input_items: what the response ran with, instructions apart (order asc
    or desc, the default; limit 1-100, default 20; after: an item id)."""
    store, owner, rid = server(request).responses, request.scope.get(KEY_ID, ""), request.path_params["response_id"]
    q = query(request, ("order", "limit", "after"))
    order, limit = q.get("order", "desc"), q.get("limit", "20")
    if order not in ("asc", "desc"):
        raise ApiError(f"order must be asc or desc, not {order!r}", param="order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise ApiError(f"limit must be an integer from 1 to 100, not {limit!r}", param="limit")
    return json_response(page(store.input_items(owner, rid), order, int(limit), q.get("after")))
