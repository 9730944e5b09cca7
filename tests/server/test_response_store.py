"""Stored responses (server/response_store.py): /v1/responses keeps each turn unless its body says
store false; previous_response_id runs the chain's items before the new input (instructions not
carried over); GET, DELETE and input_items read them back; memory is bounded, least recently used
dropped first; a response belongs to the API key that made it. A background response answers at
once (queued), runs on, reads live, and ends completed, failed or cancelled."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from streamer.config import ConfigError, ServerConfig
from streamer.messages import GenerateRequest, RequestOutput
from streamer.server.app import create_app
from streamer.server.protocol import ApiError
from streamer.server.response_store import ResponseStore, Turn, as_stored, page
from tests.server.fakes import RecordingEngine, events_of

PATH = "/v1/responses"


def serve(**config: Any) -> Iterator[tuple[RecordingEngine, TestClient]]:
    engine = RecordingEngine()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",), **config))) as client:
        yield engine, client


@pytest.fixture
def fake() -> Iterator[tuple[RecordingEngine, TestClient]]:
    yield from serve()


def post(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post(PATH, json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- through the endpoints ----------------------------------------------------------------


def test_previous_response_id_runs_the_conversation_so_far(fake):
    engine, client = fake
    first = post(client, input="Name a color.", instructions="Be brief.")
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    second = post(client, input=[call, {"type": "function_call_output", "call_id": "c1", "output": "42"}],
                  previous_response_id=first["id"])
    post(client, input="And now?", previous_response_id=second["id"], instructions="Be kind.")
    assert first["store"] is True and second["previous_response_id"] == first["id"]
    assert engine.sent[-1].messages == [
        {"role": "system", "content": "Be kind."},  # (this request's instructions only)
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "ok", "tool_calls": [  # (a call after an answer joins it)
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "And now?"},
    ]


def test_a_stored_response_reads_back_as_answered_until_deleted(fake):
    _, client = fake
    first = post(client, input="Hi", metadata={"k": "v"})
    assert client.get(f"{PATH}/{first['id']}").json() == first
    r = client.delete(f"{PATH}/{first['id']}")
    assert r.status_code == 200 and r.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    for r in (client.get(f"{PATH}/{first['id']}"), client.delete(f"{PATH}/{first['id']}"),
              client.post(PATH, json={"input": "Hi", "previous_response_id": first["id"]})):
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    assert r.json()["error"]["param"] == "previous_response_id"


def test_a_stream_is_stored_once_it_ended(fake):
    _, client = fake
    r = client.post(PATH, json={"input": "Hi", "stream": True})
    last = events_of(r.text)[-1]
    assert last["type"] == "response.completed"
    assert client.get(f"{PATH}/{last['response']['id']}").json() == last["response"]


def test_input_items_list_what_the_response_ran_with(fake):
    _, client = fake
    first = post(client, input="One", instructions="Be brief.")
    second = post(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "Two"}]}],
                  previous_response_id=first["id"])
    listed = client.get(f"{PATH}/{second['id']}/input_items", params={"order": "asc"}).json()
    data = listed["data"]
    assert [(i["type"], i.get("role")) for i in data] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user")]
    assert data[0]["content"] == [{"type": "input_text", "text": "One"}] and data[0]["id"].startswith("msg_")
    assert data[1] == first["output"][0]
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == (data[0]["id"], data[2]["id"], False)
    newest = client.get(f"{PATH}/{second['id']}/input_items", params={"limit": 1}).json()  # (desc by default)
    assert newest["data"] == [data[2]] and newest["has_more"]
    rest = client.get(f"{PATH}/{second['id']}/input_items", params={"limit": 5, "after": data[2]["id"]}).json()
    assert rest["data"] == [data[1], data[0]] and not rest["has_more"]


@pytest.mark.parametrize(("query", "param"), [({"order": "up"}, "order"), ({"limit": "0"}, "limit"),
                                              ({"limit": "x"}, "limit"), ({"after": "msg_none"}, "after"),
                                              ({"include": "x"}, "include")])
def test_bad_list_queries_are_a_400_naming_them(fake, query, param):
    _, client = fake
    rid = post(client, input="Hi")["id"]
    r = client.get(f"{PATH}/{rid}/input_items", params=query)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.get(f"{PATH}/{rid}", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_store_false_keeps_nothing(fake):
    _, client = fake
    out = post(client, input="Hi", store=False)
    assert out["store"] is False and client.get(f"{PATH}/{out['id']}").status_code == 404
    assert len(client.app.state.server.responses) == 0


def test_a_server_without_a_store_refuses_store_true_and_keeps_nothing_by_default():
    for engine, client in serve(responses_store_mb=0):
        r = client.post(PATH, json={"input": "Hi", "store": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "store"
        assert "--responses-store-mb" in r.json()["error"]["message"] and not engine.sent
        out = post(client, input="Hi")
        assert out["store"] is False and client.get(f"{PATH}/{out['id']}").status_code == 404
    with pytest.raises(ConfigError, match="responses-store-mb"):
        ServerConfig(responses_store_mb=-1)


def test_another_api_key_cannot_see_or_continue_a_response():
    for _, client in serve(api_keys=("a", "b")):
        a, b = {"Authorization": "Bearer a"}, {"Authorization": "Bearer b"}
        r = client.post(PATH, json={"input": "secret"}, headers=a)
        rid = r.json()["id"]
        assert client.get(f"{PATH}/{rid}", headers=a).status_code == 200
        assert client.get(f"{PATH}/{rid}", headers=b).status_code == 404
        assert client.get(f"{PATH}/{rid}/input_items", headers=b).status_code == 404
        assert client.delete(f"{PATH}/{rid}", headers=b).status_code == 404
        assert client.post(PATH, json={"input": "x", "previous_response_id": rid}, headers=b).status_code == 404
        assert client.get(f"{PATH}/{rid}").status_code == 401


# ---- background responses -----------------------------------------------------------------


class Gated(RecordingEngine):
    """Answers "Sun" at once, then " and rain." once `gate` is set (or the first output is an
    error, with `refuse`); records requests whose outputs stopped being read."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.refuse: str | None = None
        self.closed: list[str] = []

    async def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        import asyncio

        self.sent.append(request)
        rid = request.request_id
        if self.refuse:
            yield RequestOutput(rid, [], "", finished=True, finish_reason="error", error=self.refuse)
            return
        try:
            yield RequestOutput(rid, [5], "Sun", prompt_tokens=3, completion_tokens=1)
            while not self.gate.is_set():  # (the test's thread opens it; cancellable here)
                await asyncio.sleep(0.002)
            yield RequestOutput(rid, [6], " and rain.", finished=True, finish_reason="stop", prompt_tokens=3,
                                completion_tokens=2)
        finally:
            self.closed.append(rid)


@pytest.fixture
def gated() -> Iterator[tuple[Gated, TestClient]]:
    engine = Gated()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client


def settled(client: TestClient, rid: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    """GET the response until its status is one of statuses (a client polling; 2 s at most)."""
    for _ in range(400):
        out = client.get(f"{PATH}/{rid}").json()
        if out["status"] in statuses:
            return out
        time.sleep(0.005)
    raise AssertionError(f"{rid} stayed {out['status']}")


def test_a_background_response_answers_at_once_reads_live_and_is_stored_when_it_ends(gated):
    engine, client = gated
    queued = post(client, input="Weather?", background=True)
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    running = settled(client, queued["id"], ("in_progress",))
    assert running["output"] == []  # (the message is still open)
    r = client.post(PATH, json={"input": "And?", "previous_response_id": queued["id"]})
    assert r.status_code == 400 and "still running" in r.json()["error"]["message"]
    engine.gate.set()
    done = settled(client, queued["id"], ("completed",))
    assert done["output"][0]["content"][0]["text"] == "Sun and rain." and done["usage"]["output_tokens"] == 2
    assert client.post(f"{PATH}/{queued['id']}/cancel").json() == done  # (ended: returned as it is)


def test_cancelling_a_background_response_stops_its_request_and_keeps_what_it_wrote(gated):
    engine, client = gated
    rid = post(client, input="Weather?", background=True)["id"]
    settled(client, rid, ("in_progress",))
    r = client.post(f"{PATH}/{rid}/cancel")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "cancelled" and engine.closed == [engine.sent[0].request_id]
    (item,) = out["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Sun"
    assert client.get(f"{PATH}/{rid}").json() == out
    engine.gate.set()
    plain = post(client, input="Hi", store=True)
    r = client.post(f"{PATH}/{plain['id']}/cancel")
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]


def test_a_refused_background_request_fails_in_its_response(gated):
    engine, client = gated
    engine.refuse = "the grammar cannot be compiled"
    rid = post(client, input="Weather?", background=True)["id"]
    out = settled(client, rid, ("failed",))
    assert out["error"]["message"] == "the grammar cannot be compiled"


def test_the_server_stopping_cancels_background_responses():
    engine = Gated()
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        rid = post(client, input="Weather?", background=True)["id"]
        settled(client, rid, ("in_progress",))
        store = client.app.state.server.responses
    engine.gate.set()
    assert store.get("", rid).response["status"] == "cancelled"


@pytest.mark.parametrize(("body", "param"), [({"background": True, "store": False}, "background"),
                                             ({"background": True, "stream": True}, "stream")])
def test_background_needs_storage_and_no_stream(fake, body, param):
    engine, client = fake
    r = client.post(PATH, json={"input": "Hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and not engine.sent


# ---- the store itself -----------------------------------------------------------------------


def turn(rid: str, text: str = "x", previous: str | None = None) -> Turn:
    return Turn.of({"id": rid, "output": [{"type": "message", "role": "assistant", "content": text}]},
                   [{"type": "message", "role": "user", "content": text}], previous)


def test_the_least_recently_used_turns_go_first_when_over_budget():
    one = turn("r1")
    store = ResponseStore(3 * one.size)
    for rid in ("r1", "r2", "r3"):
        store.put("", turn(rid))
    store.get("", "r1")  # (used: r2 is now the oldest)
    store.put("", turn("r4"))
    assert len(store) == 3 and store.bytes == 3 * one.size
    with pytest.raises(ApiError):
        store.get("", "r2")
    store.put("", turn("big", "y" * 4 * one.size))  # (larger than the budget: not kept, the others stay)
    assert len(store) == 3 and store.bytes == 3 * one.size
    with pytest.raises(ApiError):
        store.get("", "big")


def test_continuing_a_chain_marks_every_turn_of_it_used_and_needs_all_of_them():
    store = ResponseStore(1 << 20)
    store.put("", turn("r1", "a"))
    store.put("", turn("r2", "b", previous="r1"))
    store.put("", turn("other"))
    assert [i["content"] for i in store.history("", "r2")] == ["a", "a", "b", "b"]
    assert list(store._turns)[-2:] == [("", "r2"), ("", "r1")]  # (both used just now)
    store.delete("", "r1")
    with pytest.raises(ApiError, match="'r1'") as e:
        store.history("", "r2")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    with pytest.raises(ApiError):
        store.history("someone", "other")


def test_stored_inputs_are_typed_given_ids_and_text_parts():
    ids = iter(range(10))
    items = as_stored([{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                           "arguments": "{}"}, {"id": "mine", "role": "assistant",
                                                                                "content": "Yo"}],
                      lambda prefix: f"{prefix}_{next(ids)}")
    assert items == [
        {"id": "msg_0", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "message", "id": "mine", "role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
    ]
    listed = page(items, "asc", 2, None)
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == ("msg_0", "fc_1", True)
    assert page([], "desc", 20, None) == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                          "has_more": False}
