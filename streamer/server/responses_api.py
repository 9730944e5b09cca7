"""/v1/responses: OpenAI's Responses API, run as a chat completion.

The request becomes a chat request (chat_body, input_messages): `instructions` a system
message first; `input` a user message (a string) or items: messages ({role, content}: text
parts only), an earlier answer's function_call (a tool call of the assistant message before
it, or of a new one), its function_call_output (a tool message), an earlier reasoning item
(the next assistant message's reasoning_content, which the template keeps or drops); function
tools (flat: chat nests them under "function"), tool_choice, and text.format (chat's
response_format). From there it runs as a chat completion does: openai_api.chat_requests
(sampling defaults, tool grammars, reasoning), ServerState.start (a bad request is a 400
before any byte of a stream).

The output (ResponseBuilder) is the chat output's split (ChatOutput: reasoning, content,
calls) as items, in the order the model wrote them: a reasoning item, a message with one
output_text, a function_call item per call. A whole response and a stream come from the same
builder, so the stream's last event carries the whole response's body.

The stream: SSE events named by their type, each with its sequence_number:
response.created, response.in_progress; for each item output_item.added, then
  message: content_part.added, output_text.delta..., output_text.done, content_part.done
  reasoning: content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
  function_call: function_call_arguments.delta, function_call_arguments.done
and output_item.done; last response.completed, response.incomplete (max_output_tokens
reached: incomplete_details.reason) or response.failed (an error after the stream began).

Nothing is stored (fields.RESPONSES_REFUSED: store, previous_response_id, background, ...).
Logprobs (include "message.output_text.logprobs", or top_logprobs) are those of the
output_text's tokens: with tools or a reasoning parser, tokens are not the message's alone,
and they are refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from streamer.messages import RequestOutput
from streamer.server import protocol as p
from streamer.server import responses as r
from streamer.server.chat_output import ChatDelta, ChatSetup
from streamer.server.fields import NO_STORE, RESPONSES_REFUSED, check_refused
from streamer.server.openai_api import chat_requests, json_response, server
from streamer.server.openai_output import Choice, Formatter
from streamer.server.protocol import ApiError
from streamer.server.sse_response import EventStream
from streamer.server.state import Merged, failure, feed_answer, one_answer, until_disconnect
from streamer.sse import data_event

LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS,)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "refusal")}


# ---- request -> chat request ---------------------------------------------------------


def parts_text(content: str | list[p.ResponseInputPart] | None, kinds: tuple[str, ...], param: str) -> str:
    """A content's text: a string, or its parts' texts joined (parts of other kinds refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, part in enumerate(content):
        if part.type not in kinds:
            raise ApiError(f"{param}[{k}]: content parts of type {part.type!r} are not supported here "
                           f"(this server takes text: {', '.join(kinds)})", param=f"{param}[{k}].type")
        texts.append(part.text if part.type != "refusal" else part.refusal or "")
    return "".join(t or "" for t in texts)


def input_messages(body: p.ResponsesRequest) -> list[dict[str, Any]]:
    """instructions and input as chat messages (the module's docstring says how)."""
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    items = [p.ResponseInputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise ApiError("input must not be empty", param="input")
    reasoning: str | None = None  # an earlier reasoning item, for the next assistant message

    def assistant(msg: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        msgs.append(msg)
        return msg

    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role not in ROLES:
                raise ApiError(f"{at}.role must be one of {', '.join(ROLES)}, not {item.role!r}", param=f"{at}.role")
            text = parts_text(item.content, TEXT_PARTS[item.role], f"{at}.content")
            if item.role == "assistant":
                assistant({"role": "assistant", "content": text})
            else:
                msgs.append({"role": item.role, "content": text})
        elif kind == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(f"{at}: a function_call item needs call_id, name and arguments", param=at)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # (calls of one answer: one message)
            else:
                assistant({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.call_id is None or item.output is None:
                raise ApiError(f"{at}: a function_call_output item needs call_id and output", param=at)
            msgs.append({"role": "tool", "tool_call_id": item.call_id,
                         "content": parts_text(item.output, ("input_text", "output_text"), f"{at}.output")})
        elif kind == "reasoning":
            text = parts_text(item.content, ("reasoning_text",), f"{at}.content") if item.content else \
                parts_text(item.summary, ("summary_text",), f"{at}.summary")
            reasoning = text if reasoning is None else f"{reasoning}\n{text}"
        elif kind == "item_reference":
            raise ApiError(f"{at}: item_reference is not supported: {NO_STORE}", param=f"{at}.type")
        else:
            raise ApiError(f"{at}: input items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output and reasoning are)", param=f"{at}.type")
    return msgs


def chat_tools(tools: list[p.ResponseTool] | None) -> list[p.Tool] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise ApiError(f"tools[{i}]: tools of type {t.type!r} are not supported: only function tools (the "
                           "server runs no tool itself)", param=f"tools[{i}].type")
        if not t.name:
            raise ApiError(f"tools[{i}]: a function tool needs a name", param=f"tools[{i}].name")
        out.append(p.Tool("function", p.FunctionDef(t.name, t.description, t.parameters, t.strict)))
    return out


def chat_tool_choice(choice: str | p.ResponseToolChoice | None) -> str | p.NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise ApiError(f"tool_choice of type {choice.type!r} is not supported: none, auto, required, or "
                       '{"type": "function", "name": ...}', param="tool_choice")
    return p.NamedToolChoice("function", p.FunctionName(choice.name))


def chat_format(text: p.ResponseText | None) -> p.ResponseFormat | None:
    if text is None:
        return None
    if text.verbosity not in (None, "medium"):
        raise ApiError("text.verbosity is not supported: it may only be medium (the default)",
                       param="text.verbosity")
    f = text.format
    if f.type == "text":
        return None
    if f.type == "json_object":
        return p.ResponseFormat("json_object")
    if f.type == "json_schema":
        if f.schema_ is None:
            raise ApiError("text.format json_schema needs schema", param="text.format.schema")
        return p.ResponseFormat("json_schema", p.JsonSchemaFormat(f.name, f.schema_, f.strict, f.description))
    raise ApiError(f"unknown text.format type {f.type!r} (text, json_object or json_schema)",
                   param="text.format.type")


def chat_body(body: p.ResponsesRequest, logprobs: bool) -> p.ChatCompletionRequest:
    """The chat request that runs this one (its messages apart: input_messages)."""
    shared = {f: getattr(body, f) for f in p.SamplingFields.__struct_fields__
              if f not in ("n", "max_tokens", "response_format")}  # (refused: fields.RESPONSES_REFUSED)
    return p.ChatCompletionRequest(
        messages=[], max_completion_tokens=body.max_output_tokens, logprobs=logprobs, top_logprobs=body.top_logprobs,
        tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, chat_template_kwargs=body.chat_template_kwargs,
        response_format=chat_format(body.text), **shared)


def wants_logprobs(body: p.ResponsesRequest) -> bool:
    for k, name in enumerate(body.include or ()):
        if name not in INCLUDABLE:
            raise ApiError(f"include {name!r} is not supported (only {', '.join(INCLUDABLE)})",
                           param=f"include[{k}]")
    return LOGPROBS in (body.include or ()) or body.top_logprobs is not None


# ---- output -> items and events ------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class OpenItem:
    """The output item being streamed: what it has gathered so far."""

    kind: str
    """message, reasoning or function_call"""
    id: str
    text: list[str] = field(default_factory=list)
    """The message's text, the reasoning, or the call's arguments, in pieces."""
    logprobs: list[r.TokenLogprob] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseBuilder:
    """One response's output items, built from the engine's outputs as they come; the events
    of a stream on the way (taken with take())."""

    def __init__(self, response: r.ResponseObject, setup: ChatSetup, fmt: Formatter, logprobs: bool) -> None:
        self.response = response
        self.chat = setup.output()
        self.fmt, self.logprobs = fmt, logprobs
        self.choice = Choice()
        self.reasoning_tokens = 0
        self.seq = 0
        self.pending: list[bytes] = []
        self.item: OpenItem | None = None

    def emit(self, kind: str, **fields: Any) -> None:
        self.pending.append(b"event: " + kind.encode() + b"\n" +
                            data_event({"type": kind, "sequence_number": self.seq, **fields}))
        self.seq += 1

    def take(self) -> bytes:
        data, self.pending = b"".join(self.pending), []
        return data

    def opening(self) -> None:
        self.emit("response.created", response=self.response)
        self.emit("response.in_progress", response=self.response)

    # ---- items

    @property
    def index(self) -> int:
        """The open item's output_index."""
        return len(self.response.output)

    def open(self, kind: str, call_id: str = "", name: str = "") -> OpenItem:
        """The open item if it is of this kind (a call is never continued), else a new one."""
        if self.item is not None and self.item.kind == kind and kind != "function_call":
            return self.item
        self.close("completed")
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = self.item = OpenItem(kind, new_id(prefix), call_id=call_id, name=name)
        at = {"output_index": self.index}
        if kind == "message":
            self.emit("response.output_item.added", **at, item=r.MessageItem(item.id, "in_progress", "assistant", []))
            self.emit("response.content_part.added", **at, item_id=item.id, content_index=0, part=r.OutputText(""))
        elif kind == "reasoning":
            self.emit("response.output_item.added", **at, item=r.ReasoningItem(item.id, [], [], "in_progress"))
            self.emit("response.content_part.added", **at, item_id=item.id, content_index=0, part=r.ReasoningText(""))
        else:
            self.emit("response.output_item.added", **at,
                      item=r.FunctionCallItem(item.id, call_id, name, "", "in_progress"))
        return item

    def close(self, status: str) -> None:
        """Finish the open item (status: its own, completed or incomplete)."""
        item, self.item = self.item, None
        if item is None:
            return
        text = "".join(item.text)
        at = {"output_index": self.index, "item_id": item.id}
        done: r.OutputItem
        if item.kind == "message":
            part = r.OutputText(text, logprobs=item.logprobs)
            self.emit("response.output_text.done", **at, content_index=0, text=text, logprobs=part.logprobs)
            self.emit("response.content_part.done", **at, content_index=0, part=part)
            done = r.MessageItem(item.id, status, "assistant", [part])
        elif item.kind == "reasoning":
            self.emit("response.reasoning_text.done", **at, content_index=0, text=text)
            self.emit("response.content_part.done", **at, content_index=0, part=r.ReasoningText(text))
            done = r.ReasoningItem(item.id, [], [r.ReasoningText(text)], status)
        else:
            self.emit("response.function_call_arguments.done", **at, name=item.name, arguments=text)
            done = r.FunctionCallItem(item.id, item.call_id, item.name, text, status)
        self.emit("response.output_item.done", output_index=self.index, item=done)
        self.response.output.append(done)

    def apply(self, d: ChatDelta, out: RequestOutput) -> None:
        if d.reasoning:
            item = self.open("reasoning")
            item.text.append(d.reasoning)
            self.emit("response.reasoning_text.delta", output_index=self.index, item_id=item.id, content_index=0,
                      delta=d.reasoning)
        lps = self.fmt.chat_logprobs(out.logprobs or []) if self.logprobs else None
        if d.content or lps is not None:
            item = self.open("message")
            item.text.append(d.content)
            tokens = (lps.content or []) if lps is not None else []
            item.logprobs.extend(tokens)
            self.emit("response.output_text.delta", output_index=self.index, item_id=item.id, content_index=0,
                      delta=d.content, logprobs=tokens)
        for call in d.calls:
            if call.name is not None:  # (a call's first delta: its id and name)
                self.open("function_call", call_id=call.id or "", name=call.name)
            open_call = self.item
            if call.arguments and open_call is not None:
                open_call.text.append(call.arguments)
                self.emit("response.function_call_arguments.delta", output_index=self.index, item_id=open_call.id,
                          delta=call.arguments)

    # ---- outputs

    def feed(self, out: RequestOutput) -> None:
        """One engine output (not an error: fail() takes those)."""
        self.choice.add(out)
        d = ChatDelta(content=out.text) if self.chat.plain else self.chat.feed(out.text)
        if self.chat.in_reasoning:
            self.reasoning_tokens += len(out.token_ids)
        self.apply(d, out)
        if out.finished:
            self.finish(out.finish_reason)

    def usage(self) -> r.ResponseUsage:
        c = self.choice
        return r.ResponseUsage(c.prompt_tokens, r.InputTokensDetails(c.cached_tokens), c.completion_tokens,
                               r.OutputTokensDetails(self.reasoning_tokens), c.prompt_tokens + c.completion_tokens)

    def finish(self, reason: str | None) -> None:
        if not self.chat.plain:
            self.apply(self.chat.finish(), RequestOutput("", [], ""))
        if self.item is None and not self.response.output:
            self.open("message")  # (an empty answer is still a message)
        cut = reason in ("length", "abort")
        self.close("incomplete" if cut else "completed")
        self.response.usage = self.usage()
        if reason == "length":
            self.response.status, self.response.incomplete_details = "incomplete", r.IncompleteDetails(
                "max_output_tokens")
            self.emit("response.incomplete", response=self.response)
        elif reason == "abort":  # (the server shutting down: what was generated stands)
            self.response.status = "cancelled"
            self.response.error = r.ResponseError("cancelled", "the request was aborted before it finished")
            self.emit("response.failed", response=self.response)
        else:
            self.response.status = "completed"
            self.emit("response.completed", response=self.response)

    def fail(self, out: RequestOutput) -> None:
        """An error after the stream began: what was generated stands; response.failed says why."""
        if out.text:
            self.apply(ChatDelta(content=out.text) if self.chat.plain else self.chat.feed(out.text), out)
        self.close("incomplete")
        e = failure(out)
        self.choice.add(out)
        self.response.usage = self.usage()
        self.response.status = "failed"
        self.response.error = r.ResponseError(e.code or "server_error", e.message)
        self.emit("response.failed", response=self.response)


# ---- the endpoint ----------------------------------------------------------------------


async def responses(request: Request) -> Response:
    st = server(request)
    data = await request.body()
    body: p.ResponsesRequest = p.decode_body(data, p.ResponsesRequest)
    check_refused(data, RESPONSES_REFUSED)
    st.check_model(body.model)
    logprobs = wants_logprobs(body)
    chat = chat_body(body, logprobs)
    st.limits.sampling(chat)
    messages = input_messages(body)
    st.limits.messages(messages, "input")
    rid = new_id("resp")
    reqs, setup = chat_requests(chat, messages, rid, st, lambda sp: st.apply_policy(sp, request.scope))
    if logprobs and not (setup.tools is None and setup.reasoning is None):
        raise ApiError("logprobs are not supported with tools or a reasoning parser: the tokens are not the "
                       "message's alone", param="include" if body.include else "top_logprobs")
    params = reqs[0].params
    head = r.ResponseObject(
        rid, int(time.time()), "in_progress", st.model_name, [], body.instructions, body.max_output_tokens,
        body.parallel_tool_calls, params.temperature, params.top_p, body.top_logprobs or 0,
        given(body.tool_choice) if body.tool_choice is not None else "auto", [given(t) for t in body.tools or []], given(body.text or p.ResponseText()),
        body.metadata or {}, body.user)
    gen, buffered = await st.start(reqs)  # (admitted here, once: a refused request is still a 400)
    builder = ResponseBuilder(head, setup, Formatter(st), logprobs)
    if body.stream:
        return EventStream(events(builder, gen, buffered), sep="\n", shutdown_grace_period=20)
    done = await until_disconnect(request, feed_answer(gen, buffered, builder.feed))
    if done is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return json_response(builder.response)


def given(value: Any) -> Any:
    """A request's Struct as JSON, without the fields it left null (for the response's echo)."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, dict):
        return {k: given(v) for k, v in value.items() if v is not None}
    return value


async def events(builder: ResponseBuilder, gen: Merged, buffered: list[tuple[int, RequestOutput]]
                 ) -> AsyncIterator[bytes]:
    """The stream: the events of each engine output in one write."""
    builder.opening()
    answer = one_answer(gen, buffered)
    try:
        async for out in answer:
            if out.error:
                builder.fail(out)
                yield builder.take()
                return
            builder.feed(out)
            if data := builder.take():
                yield data
    finally:
        await answer.aclose()
