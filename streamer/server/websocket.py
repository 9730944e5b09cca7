"""WebSocket chat sessions at /v1/chat/ws: the server keeps the conversation.

Protocol (JSON text frames):

  server -> {"type": "session", "id", "model", "max_model_len", "idle_timeout"}   once, on connect
  client -> {"type": "user", "content": "...", [max_tokens, temperature, top_p, top_k, min_p,
             seed, stop, presence_penalty, frequency_penalty, repetition_penalty, ...]}
  server -> {"type": "delta", "text": "..."}                                      zero or more
  server -> {"type": "done", "finish_reason": "stop" | "length" | "abort" | "timeout",
             "usage": {"prompt_tokens", "completion_tokens", "cached_tokens"}}   ends the turn
             (on "timeout", also "error": the deadline; the reply so far stays in the history)
  client -> {"type": "user", ..., "tools": [...], "tool_choice", "parallel_tool_calls",
             "chat_template_kwargs", "reasoning_effort"}   a turn that may call tools (as in chat completions)
  server -> {"type": "reasoning", "text": "..."}  the model's <think> text (--reasoning-parser)
  server -> {"type": "tool_calls", "tool_calls": [{"id", "type", "function": {"name",
             "arguments"}}]}   before done (finish_reason "tool_calls"): the turn waits for results
  client -> {"type": "tool", "tool_call_id": "...", "content": "..."}   one result; once every
             call has one, the turn continues (a new reply, with the same tools and sampling;
             tool_choice "auto" where it was "required" or named, which would call again)
  client -> {"type": "cancel"}   stop the running turn (it ends with done, finish_reason "abort")
  client -> {"type": "reset"}    forget the conversation; server answers {"type": "reset"}
  server -> {"type": "error", "message": "..."}   bad input; the session stays open

Each turn's prompt is the chat template over the whole history (user, assistant and
tool messages so far; an answer's reasoning is kept as its reasoning_content, which the
template keeps or drops), so it starts with the previous turn's prompt and
reply: the radix cache serves that prefix, and usage.cached_tokens grows turn
after turn. The history stays pinned in the cache while the session is open
(SamplingParams.keep_prefix): with a host tier (--host-kv-cache-gb) a turn after a
long idle is a host hit (usage.cached_host_tokens), not a recompute. A session whose client goes away aborts its running turn. A
session idle (no message, no running turn) for session_idle_timeout seconds
is closed with code 1000 and a reason. With an API key set, the key comes as
`Authorization: Bearer KEY` or `?api_key=KEY` (browsers cannot set headers
here); a wrong key closes the socket with code 1008. When the engine dies, every
session gets an error message and is closed with 1011 (ServerState.watch_engine; a
running turn's failure does the same).

A turn's pipeline: the frame -> ClientMessage (protocol.decode_body) -> the limits ->
turn_request: a GenerateRequest with the whole history as messages and SamplingParams
(protocol.to_sampling_params, the model's sampling defaults for what the message omits;
without max_tokens the turn fills the context, resolved by the engine's tokenizer) -> admit + ServerState.stream -> delta frames, then done.

Before this module runs, guard.HostCheck has refused (403) a handshake from a foreign
Origin; uvicorn closes a frame larger than --max-request-bytes with 1009; a turn over the
request limits (server/limits.py, the history counted with the new message) is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import msgspec
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from streamer.messages import ENGINE_DOWN, GenerateRequest
from streamer.router.keys import session_request_id
from streamer.server import protocol as p
from streamer.server.chat_output import ChatDelta, ChatSetup, finish_reason
from streamer.server.fields import WEBSOCKET_REFUSED, check_refused
from streamer.server.guard import KEY_ID, bearer, key_id, matching_key
from streamer.server.openai_api import chat_setup
from streamer.server.protocol import ApiError
from streamer.server.state import ServerState, failure
from streamer.server.tool_stream import ToolCallDelta, collect_calls

ENDPOINT = "/v1/chat/ws"


class ClientMessage(p.ChatFields, kw_only=True):
    type: str
    content: str | None = None
    tool_call_id: str | None = None


async def chat_session(ws: WebSocket) -> None:
    st: ServerState = ws.app.state.server
    await ws.accept()
    keys = st.config.api_keys
    if keys:
        key = (matching_key(keys, bearer(ws.headers.get("authorization", "")))
               or matching_key(keys, ws.query_params.get("api_key")))
        if key is None:
            await ws.close(1008, "missing or wrong API key")
            return
        ws.scope[KEY_ID] = key_id(key)  # (its tenant's cache namespace: ServerState.apply_policy)
    session = Session(st, ws)
    st.sessions.add(session)
    try:
        await session.run()
    finally:
        st.sessions.discard(session)


class Session:
    def __init__(self, st: ServerState, ws: WebSocket) -> None:
        self.st, self.ws = st, ws
        self.id = uuid.uuid4().hex[:12]
        self.messages: list[dict[str, Any]] = []
        self.turn: asyncio.Task | None = None
        self.turn_rid: str | None = None
        self.turns = 0
        self.last_active = time.monotonic()
        self.send_lock = asyncio.Lock()
        self.closed = False
        self.pending_calls: list[str] = []
        """Ids of the last answer's tool calls that have no result yet."""
        self.calling: ClientMessage | None = None
        """The user message whose turn called tools: its continuation's tools and sampling."""

    @property
    def keep_key(self) -> str:
        """The key the engine pins this session's history under (SamplingParams.keep_prefix)."""
        return f"ws-{self.id}"

    @property
    def busy(self) -> bool:
        return self.turn is not None and not self.turn.done()

    async def send(self, obj: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.ws.send_text(msgspec.json.encode(obj).decode())

    async def engine_down(self, reason: str | None) -> None:
        """The engine died: tell the client, and close with 1011 (the session cannot go on)."""
        async with self.send_lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(Exception):  # (the client may be gone already)
                await self.ws.send_text(msgspec.json.encode(
                    {"type": "error", "message": f"the engine is down: {reason}"}).decode())
                await self.ws.close(1011, "the engine is down")

    async def run(self) -> None:
        idle = self.st.config.session_idle_timeout
        await self.send({"type": "session", "id": self.id, "model": self.st.model_name,
                         "max_model_len": self.st.info.max_model_len, "idle_timeout": idle})
        try:
            while True:
                msg = await self.receive(idle)
                if msg is None:
                    await self.ws.close(1000, f"session idle for {idle:g} s; closed")
                    return
                if msg["type"] == "websocket.disconnect":
                    return
                self.last_active = time.monotonic()
                await self.handle(msg.get("text") or msg.get("bytes") or b"")
        except WebSocketDisconnect:
            return
        finally:
            if self.turn is not None:
                self.turn.cancel()  # closes its engine stream, which aborts the request
            self.st.engine.abort(self.keep_key)  # its history need not stay in the prefix cache

    async def receive(self, idle: float) -> Message | None:
        """The next client message, or None once the session has been idle for `idle` seconds."""
        while True:
            left = idle if self.busy else self.last_active + idle - time.monotonic()
            if left <= 0:
                return None
            try:
                return await asyncio.wait_for(self.ws.receive(), left)
            except TimeoutError:
                continue

    async def handle(self, data: str | bytes) -> None:
        try:
            raw = data.encode() if isinstance(data, str) else data
            msg: ClientMessage = p.decode_body(raw, ClientMessage)
            check_refused(raw, WEBSOCKET_REFUSED)  # (as the HTTP bodies: fields.py)
            if msg.type == "user":
                self.start_turn(msg)
            elif msg.type == "tool":
                self.tool_result(msg)
            elif msg.type == "cancel":
                if self.busy and self.turn_rid:
                    self.st.engine.abort(self.turn_rid)
            elif msg.type == "reset":
                await self.stop_turn()
                self.messages.clear()
                self.st.engine.abort(self.keep_key)
                self.pending_calls, self.calling = [], None
                await self.send({"type": "reset"})
            else:
                raise ApiError(f"unknown message type {msg.type!r} (user, tool, cancel or reset)")
        except ApiError as e:
            await self.send({"type": "error", "message": e.message})

    def start_turn(self, msg: ClientMessage) -> None:
        if self.busy:
            raise ApiError("a reply is still streaming: wait for done, or send cancel")
        if not msg.content:
            raise ApiError("a user message needs a non-empty content string")
        if self.pending_calls:
            raise ApiError(f"the last answer called tools: send a tool message for {', '.join(self.pending_calls)}")
        self.begin(msg, {"role": "user", "content": msg.content})

    def tool_result(self, msg: ClientMessage) -> None:
        """One tool call's result; the last one missing continues the turn."""
        if self.busy:
            raise ApiError("a reply is still streaming: wait for done, or send cancel")
        if msg.tool_call_id not in self.pending_calls:
            waiting = ", ".join(self.pending_calls) or "none"
            raise ApiError(f"no tool call {msg.tool_call_id!r} waits for a result (waiting: {waiting})")
        entry = {"role": "tool", "tool_call_id": msg.tool_call_id, "content": msg.content or ""}
        if len(self.pending_calls) > 1:
            self.st.limits.messages([*self.messages, entry], "content")
            self.pending_calls.remove(msg.tool_call_id)
            self.messages.append(entry)
            return
        assert self.calling is not None
        self.begin(self.calling, entry)
        self.pending_calls = []

    def begin(self, msg: ClientMessage, entry: dict[str, Any]) -> None:
        """Start a turn whose history ends with `entry` (a user message or a tool result);
        msg holds the turn's sampling and tools."""
        if msg.n != 1:
            raise ApiError("n must be 1 in a chat session")
        self.st.limits.sampling(msg)
        # the turn's prompt is the whole conversation: its limits apply to the history with this message
        self.st.limits.messages([*self.messages, entry], "content")
        self.st.check_model(msg.model, self.ws.scope)
        req, setup = self.turn_request(msg, entry, session_request_id(self.id, self.turns + 1))
        self.turns += 1
        self.turn_rid = req.request_id
        self.messages.append(entry)  # (popped if the turn fails)
        self.turn = asyncio.create_task(self.run_turn(req, setup, msg))
        # a send to a closed socket ends the turn with an exception: retrieve it, nobody awaits it
        self.turn.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def stop_turn(self) -> None:
        if self.busy and self.turn is not None and self.turn_rid:
            self.st.engine.abort(self.turn_rid)
            with contextlib.suppress(Exception):
                await self.turn

    def turn_request(self, msg: ClientMessage, entry: dict[str, Any], rid: str) -> tuple[GenerateRequest, ChatSetup]:
        """The engine request of a turn: the history and `entry` as messages; without
        max_tokens, the reply may fill the context (the engine's tokenizer resolves it)."""
        params = p.to_sampling_params(msg, max_tokens=msg.max_tokens, logprobs=None,
                                      vocab_size=self.st.info.vocab_size, fill_context=True,
                                      defaults=self.st.sampling_defaults)
        setup, kwargs = chat_setup(self.st, msg, params.grammar)
        # the history stays in the prefix cache (device or host tier) while the session is open
        params = msgspec.structs.replace(params, grammar=setup.grammar, keep_special_tokens=list(setup.keep_special),
                                         keep_prefix=self.keep_key,
                                         keep_prefix_s=min(self.st.config.session_idle_timeout + 60, 1e9))
        params = self.st.apply_policy(params, self.ws.scope)
        tools = msgspec.to_builtins(msg.tools) if msg.tools else None
        return GenerateRequest(request_id=rid, messages=[*self.messages, entry], params=params, tools=tools,
                               chat_template_kwargs=kwargs), setup

    async def run_turn(self, req: GenerateRequest, setup: ChatSetup, msg: ClientMessage) -> None:
        reply: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCallDelta] = []
        output = setup.output()
        last = None

        async def emit(d: ChatDelta) -> None:
            calls.extend(d.calls)
            if d.reasoning:
                reasoning.append(d.reasoning)
                await self.send({"type": "reasoning", "text": d.reasoning})
            if d.content:
                reply.append(d.content)
                await self.send({"type": "delta", "text": d.content})

        try:
            self.st.admit(1)
            async with contextlib.aclosing(self.st.stream([req])) as outputs:
                async for _, out in outputs:
                    if out.finish_reason == "error":
                        raise failure(out)
                    if out.text:
                        await emit(output.feed(out.text))
                    last = out
            await emit(output.finish())
        except ApiError as e:
            self.messages.pop()
            self.st.metrics.requests.labels(ENDPOINT, str(e.status)).inc()
            if e.code == ENGINE_DOWN:
                await self.engine_down(self.st.engine.dead)
            else:
                await self.send({"type": "error", "message": e.message})
            return
        finally:
            self.last_active = time.monotonic()
        text = "".join(reply)
        made = [msgspec.to_builtins(p.ToolCallItem(c.id, p.FunctionCall(c.name, c.arguments)))
                for c in collect_calls(calls)]
        if text or made:
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if made:
                answer["tool_calls"] = made
            if reasoning:
                answer["reasoning_content"] = "".join(reasoning)
            self.messages.append(answer)
        elif self.messages[-1]["role"] == "user":
            self.messages.pop()  # nothing to answer to: keep user/assistant turns alternating
        self.st.metrics.requests.labels(ENDPOINT, "200").inc()
        assert last is not None
        if made:
            # the continuation chooses freely: a required or named choice again would call again,
            # forever (agent frameworks reset tool_choice after a call for the same reason)
            self.pending_calls = [c["id"] for c in made]
            self.calling = msgspec.structs.replace(msg, tool_choice="auto" if msg.tool_choice != "none" else "none")
            await self.send({"type": "tool_calls", "tool_calls": made})
        usage = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                 "cached_tokens": last.cached_tokens, "cached_host_tokens": last.cached_host_tokens}
        done: dict[str, Any] = {"type": "done", "finish_reason": finish_reason(last.finish_reason, bool(made)),
                                "usage": usage}
        if last.finish_reason == "timeout":
            done["error"] = last.error  # (what was generated until the deadline is kept in the history)
        await self.send(done)
