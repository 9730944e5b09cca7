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

The output, items and the stream's events, is responses_output.py's (ResponseBuilder).

Responses are stored (store, on unless false), continued (previous_response_id) and run in the
background (background: true, then polled and cancelled) as response_store.py says; conversation
and item_reference are refused (fields.RESPONSES_REFUSED).
Logprobs (include "message.output_text.logprobs", or top_logprobs) are those of the
output_text's tokens: with tools or a reasoning parser, tokens are not the message's alone,
and they are refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct, field
from starlette.requests import Request
from starlette.responses import Response

from streamer.messages import GenerateRequest
from streamer.server import protocol as p
from streamer.server import responses as r
from streamer.server.fields import RESPONSES_REFUSED, check_refused
from streamer.server.guard import KEY_ID
from streamer.server.openai_api import chat_requests, json_response, server
from streamer.server.openai_output import Formatter
from streamer.server.protocol import ApiError
from streamer.server.response_store import Turn, as_stored
from streamer.server.responses_output import ResponseBuilder, new_id
from streamer.server.sse_response import EventStream
from streamer.server.state import ServerState, answer_events, feed_answer, one_answer, until_disconnect

# ---- the request -------------------------------------------------------------------


class ResponseInputPart(Struct):
    """A part of an input item's content: input_text, output_text (an earlier answer's),
    refusal, reasoning_text and summary_text (a reasoning item's); others are refused."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ResponseInputItem(Struct, kw_only=True):
    """One item of `input`: a message ({role, content}, type "message" or none), an earlier
    function_call, its function_call_output, or an earlier reasoning item."""

    type: str | None = None
    role: str | None = None
    content: str | list[ResponseInputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponseInputPart] | None = None
    summary: list[ResponseInputPart] | None = None


class ResponseTool(Struct, kw_only=True):
    """A tool of the Responses API: a function's fields sit beside its type (chat nests them)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(Struct, kw_only=True):
    type: str
    name: str | None = None


class ResponseTextFormat(Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseText(Struct, kw_only=True):
    format: ResponseTextFormat = field(default_factory=ResponseTextFormat)
    verbosity: str | None = None


class ResponseReasoning(Struct, kw_only=True):
    effort: str | None = None
    """chat's reasoning_effort (chat_template.with_reasoning_effort)."""
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(Struct):
    include_obfuscation: bool = True
    """Accepted without effect (fields.ACCEPTED)."""


class ResponsesRequest(p.SamplingFields, kw_only=True):
    """A /v1/responses body. The sampling extensions of chat (top_k, min_p, seed, stop, ...)
    apply as there; n, max_tokens and response_format are chat's and refused here
    (fields.RESPONSES_REFUSED): max_output_tokens and text.format say the same."""

    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | ResponseToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    top_logprobs: p.TopLogprobs | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: ResponseReasoning | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool = False


LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS,)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "refusal")}


# ---- request -> chat request ---------------------------------------------------------


def parts_text(content: str | list[ResponseInputPart] | None, kinds: tuple[str, ...], param: str) -> str:
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


def own_items(body: ResponsesRequest) -> list[ResponseInputItem]:
    """The request's input as items (a string: one user message)."""
    items = [ResponseInputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise ApiError("input must not be empty", param="input")
    return items


def input_messages(body: ResponsesRequest, earlier: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """instructions, the earlier turns' items (previous_response_id: response_store.history) and
    input as chat messages (the module's docstring says how)."""
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    before = msgspec.convert(list(earlier), list[ResponseInputItem])
    items = [*before, *own_items(body)]
    reasoning: str | None = None  # an earlier reasoning item, for the next assistant message

    def assistant(msg: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        msgs.append(msg)
        return msg

    for i, item in enumerate(items):
        at = f"input[{i - len(before)}]"
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
            raise ApiError(f"{at}: item_reference is not supported: send the item, or previous_response_id",
                           param=f"{at}.type")
        else:
            raise ApiError(f"{at}: input items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output and reasoning are)", param=f"{at}.type")
    return msgs


def chat_tools(tools: list[ResponseTool] | None) -> list[p.Tool] | None:
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


def chat_tool_choice(choice: str | ResponseToolChoice | None) -> str | p.NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise ApiError(f"tool_choice of type {choice.type!r} is not supported: none, auto, required, or "
                       '{"type": "function", "name": ...}', param="tool_choice")
    return p.NamedToolChoice("function", p.FunctionName(choice.name))


def chat_format(text: ResponseText | None) -> p.ResponseFormat | None:
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


def chat_body(body: ResponsesRequest, logprobs: bool) -> p.ChatCompletionRequest:
    """The chat request that runs this one (its messages apart: input_messages)."""
    shared = {f: getattr(body, f) for f in p.SamplingFields.__struct_fields__
              if f not in ("n", "max_tokens", "response_format")}  # (refused: fields.RESPONSES_REFUSED)
    reasoning = body.reasoning or ResponseReasoning()
    for name in ("summary", "generate_summary"):
        if getattr(reasoning, name) is not None:
            raise ApiError(f"reasoning.{name} is not supported: a reasoning model's reasoning comes whole in a "
                           "reasoning item (--reasoning-parser), never summarized", param=f"reasoning.{name}")
    return p.ChatCompletionRequest(
        messages=[], max_completion_tokens=body.max_output_tokens, logprobs=logprobs, top_logprobs=body.top_logprobs,
        tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, chat_template_kwargs=body.chat_template_kwargs,
        reasoning_effort=reasoning.effort, response_format=chat_format(body.text), **shared)


def wants_logprobs(body: ResponsesRequest) -> bool:
    for k, name in enumerate(body.include or ()):
        if name not in INCLUDABLE:
            raise ApiError(f"include {name!r} is not supported (only {', '.join(INCLUDABLE)})",
                           param=f"include[{k}]")
    return LOGPROBS in (body.include or ()) or body.top_logprobs is not None


# ---- the endpoint ----------------------------------------------------------------------


async def responses(request: Request) -> Response:
    st = server(request)
    data = await request.body()
    body: ResponsesRequest = p.decode_body(data, ResponsesRequest)
    check_refused(data, RESPONSES_REFUSED)
    st.check_model(body.model, request.scope)
    logprobs = wants_logprobs(body)
    chat = chat_body(body, logprobs)
    st.limits.sampling(chat)
    owner, store = request.scope.get(KEY_ID, ""), st.responses
    if body.store and not store.enabled:
        raise ApiError("store: this server stores no responses (streamer serve --responses-store-mb 0)", param="store")
    keep = store.enabled and body.store is not False
    if body.background and not keep:
        raise ApiError("background needs the response stored (store: true, and a server with --responses-store-mb "
                       "> 0): it is read back with GET /v1/responses/{id}", param="background")
    if body.background and body.stream:
        raise ApiError("stream is not supported with background: poll GET /v1/responses/{id}", param="stream")
    earlier = store.history(owner, body.previous_response_id) if body.previous_response_id is not None else []
    messages = input_messages(body, earlier)
    st.limits.messages(messages, "input")
    rid = new_id("resp")
    try:
        reqs, setup = chat_requests(chat, messages, rid, st, lambda sp: st.apply_policy(sp, request.scope))
    except ApiError as e:
        if e.param == "reasoning_effort":  # (chat's name for it)
            e.param = "reasoning.effort"
        raise
    if logprobs and not (setup.tools is None and setup.reasoning is None):
        raise ApiError("logprobs are not supported with tools or a reasoning parser: the tokens are not the "
                       "message's alone", param="include" if body.include else "top_logprobs")
    params = reqs[0].params
    head = r.ResponseObject(
        rid, int(time.time()), "in_progress", st.answering(request.scope), [], body.instructions, body.max_output_tokens,
        body.parallel_tool_calls, params.temperature, params.top_p, body.top_logprobs or 0,
        given(body.tool_choice) if body.tool_choice is not None else "auto", [given(t) for t in body.tools or []], given(body.text or ResponseText()),
        body.metadata or {}, body.user, store=keep, previous_response_id=body.previous_response_id,
        background=body.background)
    if body.reasoning is not None:
        head.reasoning = {"effort": body.reasoning.effort, "summary": None}
    inputs = as_stored([given(item) for item in own_items(body)], new_id) if keep else []

    def kept() -> None:  # (the response as its client got it, once it ended)
        if keep:
            store.put(owner, Turn.of(msgspec.to_builtins(head), inputs, body.previous_response_id))

    if body.background:
        head.status = "queued"
        kept()
        store.run(owner, rid, in_background(st, reqs, ResponseBuilder(head, setup, Formatter(st), logprobs), kept),
                  lambda: head)
        return json_response(head)
    gen, buffered = await st.start(reqs)  # (admitted here, once: a refused request is still a 400)
    builder = ResponseBuilder(head, setup, Formatter(st), logprobs, streaming=body.stream)

    if body.stream:
        async def events() -> AsyncGenerator[bytes, None]:
            async for data in answer_events(builder, gen, buffered):
                yield data
            kept()  # (not when the client left mid-stream: the response never ended for it)

        return EventStream(events(), sep="\n", shutdown_grace_period=20)
    done = await until_disconnect(request, feed_answer(gen, buffered, builder.feed))
    if done is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    kept()
    return json_response(builder.response)


async def in_background(st: ServerState, reqs: list[GenerateRequest], builder: ResponseBuilder,
                        kept: Callable[[], None]) -> None:
    """A background response's run: what a whole response's request does, its errors (a refusal
    included) the response's status and error rather than an HTTP status; stored when it ends."""
    head = builder.response
    try:
        gen, buffered = await st.start(reqs)
        head.status = "in_progress"
        answer = one_answer(gen, buffered)
        try:
            async for out in answer:
                if out.error:
                    builder.fail(out)
                    break
                builder.feed(out)
        finally:
            await answer.aclose()
    except ApiError as e:
        head.status, head.error = "failed", r.ResponseError(e.code or e.type, e.message)
    except asyncio.CancelledError:  # (POST /v1/responses/{id}/cancel, or the server stopping)
        builder.close("incomplete")
        head.status = "cancelled"
    finally:
        kept()


def given(value: Any) -> Any:
    """A request's Struct as JSON, without the fields it left null (for the response's echo)."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, dict):
        return {k: given(v) for k, v in value.items() if v is not None}
    return value
