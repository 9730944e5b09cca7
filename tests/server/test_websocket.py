"""WebSocket chat sessions: the server keeps the conversation, and the radix cache keeps its KV."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 30))


async def turn(ws, content: str, **params) -> tuple[str, dict]:
    """Send one user message; return (streamed text, done message)."""
    await ws.send(json.dumps({"type": "user", "content": content, **params}))
    text = []
    while True:
        msg = await recv(ws)
        if msg["type"] == "delta":
            text.append(msg["text"])
        elif msg["type"] == "done":
            return "".join(text), msg
        else:
            raise AssertionError(f"unexpected {msg}")


async def open_session(live):
    ws = await connect(f"{live.ws_url}/v1/chat/ws")
    hello = await recv(ws)
    assert hello["type"] == "session" and hello["model"] == "smol"
    return ws


def test_three_turns_reuse_the_cache(live):
    async def main():
        async with await open_session(live) as ws:
            dones = []
            for q in ("Hi! What is your name?", "What is 2 + 2?", "Thanks. Name a color."):
                text, done = await turn(ws, q, max_tokens=12, temperature=0)
                assert text and done["finish_reason"] in ("stop", "length")
                dones.append(done["usage"])
            return dones

    usages = asyncio.run(main())
    prompts = [u["prompt_tokens"] for u in usages]
    cached = [u["cached_tokens"] for u in usages]
    assert prompts[0] < prompts[1] < prompts[2]  # each prompt holds the whole history
    assert cached[0] < cached[1] < cached[2]  # ... and the history's KV comes from the cache
    assert cached[1] >= prompts[0] - 16 and cached[2] >= prompts[1] - 16  # all but a partial page
    live.wait_idle()


def test_cancel_reset_and_errors(live):
    async def main():
        async with await open_session(live) as ws:
            await ws.send(json.dumps({"type": "user", "content": "Write a long poem.", "max_tokens": 300,
                                      "ignore_eos": True}))
            assert (await recv(ws))["type"] == "delta"
            await ws.send(json.dumps({"type": "user", "content": "again"}))  # a turn is running
            err = await recv(ws)
            while err["type"] == "delta":
                err = await recv(ws)
            assert err["type"] == "error" and "cancel" in err["message"]
            await ws.send(json.dumps({"type": "cancel"}))
            msg = await recv(ws)
            while msg["type"] == "delta":
                msg = await recv(ws)
            assert msg["type"] == "done" and msg["finish_reason"] == "abort"
            assert msg["usage"]["completion_tokens"] < 300

            for bad in ("not json", json.dumps({"type": "dance"}), json.dumps({"type": "user"}),
                        json.dumps({"type": "user", "content": "x", "max_tokens": 0}),
                        json.dumps({"type": "user", "content": "x", "temperature": "hot"}),
                        json.dumps({"type": "user", "content": "x", "use_beam_search": True})):
                await ws.send(bad)
                m = await recv(ws)
                assert m["type"] == "error" and m["message"], bad

            await ws.send(json.dumps({"type": "reset"}))
            assert (await recv(ws)) == {"type": "reset"}
            _, done = await turn(ws, "Hi", max_tokens=4)
            return done

    done = asyncio.run(main())
    assert done["finish_reason"] in ("stop", "length")
    live.wait_idle()


def test_too_long_turn_is_an_error_and_the_session_lives_on(live):
    async def main():
        async with await open_session(live) as ws:
            await ws.send(json.dumps({"type": "user", "content": "hi " * 9000}))
            m = await recv(ws)
            assert m["type"] == "error" and "context length" in m["message"]
            _, done = await turn(ws, "Hi", max_tokens=3)
            assert done["usage"]["prompt_tokens"] < 100  # the refused message left no trace in the history

    asyncio.run(main())


def test_disconnect_aborts_the_running_turn(live):
    async def main():
        ws = await open_session(live)
        await ws.send(json.dumps({"type": "user", "content": "Tell a long story.", "max_tokens": 400,
                                  "ignore_eos": True}))
        assert (await recv(ws))["type"] == "delta"
        await ws.close()

    before = live.stats().generated_tokens_total
    asyncio.run(main())
    stats = live.wait_idle()
    assert stats.generated_tokens_total - before < 300


@pytest.fixture
def short_idle(live):
    config = live.state.config
    old, config.session_idle_timeout = config.session_idle_timeout, 0.5
    yield
    config.session_idle_timeout = old


def test_idle_session_is_closed(live, short_idle):
    async def main():
        async with await open_session(live) as ws:
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(ws.recv(), 10)
            return e.value.rcvd

    close = asyncio.run(main())
    assert close.code == 1000 and "idle" in close.reason


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


def test_a_tool_round_trip_in_a_session(live):
    """A turn with tools answers with a tool_calls message and waits; the client's tool
    result continues the turn, and the history keeps the call and its result."""
    async def main():
        async with await open_session(live) as ws:
            await ws.send(json.dumps({"type": "user", "content": "Weather in Oslo?", "tools": [WEATHER_TOOL],
                                      "tool_choice": "required", "parallel_tool_calls": False,
                                      "max_tokens": 60, "temperature": 0}))
            frames = []
            while (msg := await recv(ws))["type"] != "done":
                frames.append(msg)
            assert msg["finish_reason"] == "tool_calls"
            assert frames[-1]["type"] == "tool_calls" and not any(f["type"] == "delta" for f in frames)
            (call,) = frames[-1]["tool_calls"]
            assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
            # a new user message must wait for the result; an unknown id is refused
            await ws.send(json.dumps({"type": "user", "content": "hello?"}))
            assert "send a tool message for " + call["id"] in (await recv(ws))["message"]
            await ws.send(json.dumps({"type": "tool", "tool_call_id": "call_nope", "content": "?"}))
            assert "no tool call 'call_nope'" in (await recv(ws))["message"]
            first_prompt = msg["usage"]["prompt_tokens"]
            await ws.send(json.dumps({"type": "tool", "tool_call_id": call["id"], "content": '{"celsius": 3}'}))
            text = []
            while (msg := await recv(ws))["type"] != "done":
                assert msg["type"] in ("delta", "tool_calls"), msg  # the same tools, tool_choice now auto
                text.append(msg.get("text", ""))
            assert msg["finish_reason"] in ("tool_calls", "stop", "length")
            assert msg["usage"]["prompt_tokens"] > first_prompt  # the call and its result are in the prompt
            assert msg["usage"]["cached_tokens"] >= first_prompt - 16  # (the history's KV, from the tree)

    asyncio.run(main())


def test_a_session_keeps_its_history_pinned_in_the_cache_until_it_closes(live):
    """SamplingParams.keep_prefix: each turn pins the history under the session's key (a host
    tier then never drops it); the session's end releases it."""

    def kept() -> set[str]:
        async def read() -> set[str]:
            return set(live.state.engine.scheduler.keeps.kept)

        return asyncio.run_coroutine_threadsafe(read(), live.loop).result(10)

    async def main() -> str:
        async with connect(f"{live.ws_url}/v1/chat/ws") as ws:
            sid = (await recv(ws))["id"]
            await turn(ws, "Hi!", max_tokens=4, temperature=0)
            for _ in range(100):
                if f"ws-{sid}" in kept():
                    break
                await asyncio.sleep(0.02)
            assert f"ws-{sid}" in kept()
            return sid

    sid = asyncio.run(main())
    for _ in range(100):
        if f"ws-{sid}" not in kept():
            break
        time.sleep(0.02)
    assert f"ws-{sid}" not in kept(), "the closed session's pin is released"
    live.wait_idle()


def test_a_turn_takes_bad_words_and_sglangs_names_but_not_prompt_logprobs(live):
    """WebSocket turns take protocol.SamplingFields (bad_words, SGLang's regex ...), not the
    fields only completions and chat completions implement (fields.SERVED_BY_COMPLETIONS)."""

    async def main():
        async with await open_session(live) as ws:
            text, done = await turn(ws, "Count: one, two, three,", max_tokens=6, temperature=0, ignore_eos=True,
                                    bad_words=["four"], regex="[a-z ,]+")
            assert done["finish_reason"] == "length" and "four" not in text
            assert set(text) <= set("abcdefghijklmnopqrstuvwxyz ,"), text
            await ws.send(json.dumps({"type": "user", "content": "x", "prompt_logprobs": 1}))
            err = await recv(ws)
            assert err["type"] == "error" and "prompt_logprobs" in err["message"]

    asyncio.run(main())
    live.wait_idle()
