"""/v1/messages (and /v1/messages/count_tokens): Anthropic's Messages API, run as a chat completion.

For clients written against Anthropic's SDK (agents, coding tools pointed at a base URL).
The request becomes the chat request that says the same (chat_messages): `system` a system
message; a user message's text blocks its content and its tool_result blocks tool messages
(before it, as the results come first); an assistant message's text its content, its tool_use
blocks tool calls, its thinking blocks its reasoning_content; tools (`input_schema`) chat's
function tools; tool_choice auto / any / tool / none chat's auto / required / named / none
(`disable_parallel_tool_use` chat's parallel_tool_calls false); `stop_sequences` stop strings;
`output_config.format` (a JSON schema) chat's response_format; `thinking` {"type": "disabled"}
the template's enable_thinking false, {"type": "adaptive"} the template's default (with
display "omitted" the thinking blocks come empty); temperature, top_p and top_k (which
older clients send) as chat's. From there it runs as
a chat completion does (openai_api.chat_requests), and the output (ChatOutput's split) comes
back as content blocks in the order written: thinking, text, tool_use (its input parsed).

The answer's blocks, stop_reason, usage and the stream's events: anthropic_output.py
(MessageBuilder). Errors are Anthropic's body ({"type": "error", "error": {"type", "message"}}).

Accepted without effect: metadata, user_profile_id and workspace_id (ids), cache_control at
the top and on blocks (the prefix cache is automatic). Refused by name: image and document
blocks, server tools (web search, code execution, ...), MCP servers, containers and context
management, `thinking` with a budget or between tools (a reasoning model's thinking runs to its
own end here: --reasoning-parser splits it out), output_config.effort, speed "fast",
inference_geo and diagnostics.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from streamer.chat_template import render
from streamer.errors import RequestError
from streamer.server import protocol as p
from streamer.server.anthropic_output import ERROR_TYPES, MessageBuilder
from streamer.server.fields import Rule, check_refused, only, unsupported
from streamer.server.openai_api import chat_requests, server
from streamer.server.protocol import ApiError
from streamer.server.sse_response import EventStream
from streamer.server.state import answer_events, feed_answer, until_disconnect

# ---- the request ---------------------------------------------------------------------


class Block(Struct, kw_only=True):
    """A content block of a request's message (or of a tool_result's content)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class Message(Struct):
    role: str
    content: str | list[Block]


class Tool(Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    """None or "custom": a client tool; others name Anthropic's server tools, refused."""


class ToolChoice(Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None
    display: str | None = None
    """adaptive: "summarized" (the thinking is returned) or "omitted" (its blocks come empty)."""


class OutputFormat(Struct, kw_only=True):
    type: str
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class OutputConfig(Struct, kw_only=True):
    format: OutputFormat | None = None
    """Structured output: {"type": "json_schema", "schema": {...}} constrains the text (xgrammar)."""
    effort: str | None = None


class MessagesRequest(Struct, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: list[Message]
    model: str | None = None
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    """Accepted without effect (its user_id is an end-user id for Anthropic's abuse monitoring),
    as are user_profile_id and workspace_id (account ids) and cache_control, here and on blocks
    (the prefix cache is automatic: every prompt's prefix is cached and shared)."""


class CountTokensRequest(Struct, kw_only=True):
    messages: list[Message]
    model: str | None = None
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    thinking: Thinking | None = None


REFUSED: dict[str, Rule] = {
    "container": unsupported("container is not supported: this server runs no tools itself"),
    "diagnostics": unsupported("diagnostics (prompt-cache miss reasons) is not supported"),
    "inference_geo": unsupported("inference_geo is not supported: this server runs where it runs"),
    "speed": only(("standard",), "speed may only be standard (one speed here)"),
    "mcp_servers": unsupported("mcp_servers is not supported: this server connects to no MCP servers"),
    "service_tier": only(("auto", "standard_only"), "this server has one service tier: service_tier may be auto "
                                                    "or standard_only"),
    "context_management": unsupported("context_management is not supported: send the context to keep"),
}


def text_of(content: str | list[Block] | None, kinds: tuple[str, ...], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for k, b in enumerate(content):
        if b.type not in kinds:
            raise ApiError(f"{where}[{k}]: {b.type} blocks are not supported here (text is)", param=f"{where}[{k}]")
        out.append(b.text or "")
    return "".join(out)


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """system and messages as chat messages (the module's docstring says how)."""
    msgs: list[dict[str, Any]] = []
    if body.system:
        msgs.append({"role": "system", "content": text_of(body.system, ("text",), "system")})
    if not body.messages:
        raise ApiError("messages must not be empty", param="messages")
    for i, m in enumerate(body.messages):
        at = f"messages[{i}].content"
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "user":
            texts = []
            for k, b in enumerate(blocks):
                if b.type == "tool_result":
                    if b.tool_use_id is None:
                        raise ApiError(f"{at}[{k}]: a tool_result needs tool_use_id", param=f"{at}[{k}]")
                    result = text_of(b.content, ("text",), f"{at}[{k}].content")
                    msgs.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": f"Error: {result}" if b.is_error else result})
                elif b.type == "text":
                    texts.append(b.text or "")
                else:
                    raise ApiError(f"{at}[{k}]: {b.type} blocks are not supported (text and tool_result are)",
                                   param=f"{at}[{k}]")
            if texts or not any(b.type == "tool_result" for b in blocks):
                msgs.append({"role": "user", "content": "".join(texts)})
        elif m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            for k, b in enumerate(blocks):
                if b.type == "text":
                    msg["content"] += b.text or ""
                elif b.type == "tool_use":
                    if b.id is None or b.name is None:
                        raise ApiError(f"{at}[{k}]: a tool_use needs id and name", param=f"{at}[{k}]")
                    msg.setdefault("tool_calls", []).append({"id": b.id, "type": "function", "function": {
                        "name": b.name, "arguments": json.dumps(b.input if b.input is not None else {})}})
                elif b.type == "thinking":
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + (b.thinking or "")
                else:
                    raise ApiError(f"{at}[{k}]: {b.type} blocks are not supported in the history (text, tool_use "
                                   "and thinking are)", param=f"{at}[{k}]")
            msgs.append(msg)
        else:
            raise ApiError(f"messages[{i}].role must be user or assistant, not {m.role!r}", param=f"messages[{i}].role")
    return msgs


def chat_tools(tools: list[Tool] | None) -> list[p.Tool] | None:
    if not tools:
        return None
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise ApiError(f"tools[{i}]: {t.type} is a server tool, which this server does not run (client tools, "
                           "with input_schema, are supported)", param=f"tools[{i}].type")
    return [p.Tool("function", p.FunctionDef(t.name, t.description, t.input_schema or {"type": "object"}))
            for t in tools]


def chat_tool_choice(choice: ToolChoice | None) -> str | p.NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ApiError('tool_choice {"type": "tool"} needs name', param="tool_choice.name")
        return p.NamedToolChoice("function", p.FunctionName(choice.name))
    named = {"auto": "auto", "any": "required", "none": "none"}
    if choice.type not in named:
        raise ApiError(f"unknown tool_choice type {choice.type!r} (auto, any, tool or none)", param="tool_choice.type")
    return named[choice.type]


def template_kwargs(thinking: Thinking | None) -> dict[str, Any] | None:
    """disabled: the template's enable_thinking false; adaptive: the model's own way (its
    template's default). A budget (enabled) or between_tools is not something the engine can
    hold a model to: refused."""
    if thinking is None:
        return None
    if thinking.display not in (None, "summarized", "omitted"):
        raise ApiError(f"unknown thinking display {thinking.display!r}", param="thinking.display")
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    if thinking.type == "adaptive":
        return None
    if thinking.type in ("enabled", "between_tools"):
        raise ApiError(f"thinking {thinking.type} is not supported: a reasoning model's thinking runs to its own end "
                       "here (omit thinking, or send {\"type\": \"adaptive\"} or {\"type\": \"disabled\"})",
                       param="thinking")
    raise ApiError(f"unknown thinking type {thinking.type!r}", param="thinking.type")


def output_format(config: OutputConfig | None) -> p.ResponseFormat | None:
    if config is None:
        return None
    if config.effort is not None:
        raise ApiError("output_config.effort is not supported: the model answers as it does", param="output_config")
    f = config.format
    if f is None:
        return None
    if f.type != "json_schema" or f.schema_ is None:
        raise ApiError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    return p.ResponseFormat("json_schema", p.JsonSchemaFormat(schema_=f.schema_))


def chat_body(body: MessagesRequest) -> p.ChatCompletionRequest:
    parallel = not (body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use)
    return p.ChatCompletionRequest(
        messages=[], max_completion_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, stop=body.stop_sequences, tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice), parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs(body.thinking), response_format=output_format(body.output_config))


# ---- the endpoints -------------------------------------------------------------------------

def anthropic_error(e: ApiError) -> Response:
    kind = ERROR_TYPES.get(e.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    return Response(msgspec.json.encode(body), e.status, headers=e.headers, media_type="application/json")


def anthropic_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as e:
            return anthropic_error(e)
    return wrapped


@anthropic_errors
async def messages(request: Request) -> Response:
    st = server(request)
    data = await request.body()
    body: MessagesRequest = p.decode_body(data, MessagesRequest)
    check_refused(data, REFUSED)
    st.check_model(body.model, request.scope)
    chat = chat_body(body)
    st.limits.sampling(chat)
    msgs = chat_messages(body)
    st.limits.messages(msgs)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    reqs, setup = chat_requests(chat, msgs, mid, st, lambda sp: st.apply_policy(sp, request.scope))
    gen, buffered = await st.start(reqs)  # (a request the engine refuses is still a 400 here)
    shown = body.thinking is None or body.thinking.display != "omitted"
    builder = MessageBuilder(mid, st.answering(request.scope), setup, show_thinking=shown, streaming=body.stream)
    if body.stream:
        return EventStream(answer_events(builder, gen, buffered), sep="\n", shutdown_grace_period=20)
    done = await until_disconnect(request, feed_answer(gen, buffered, builder.feed))
    if done is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return Response(msgspec.json.encode(builder.message(builder.blocks)), media_type="application/json")


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the engine would render them (the chat template, tools included)."""
    st = server(request)
    body: CountTokensRequest = p.decode_body(await request.body(), CountTokensRequest)
    st.check_model(body.model, request.scope)
    msgs = chat_messages(body)
    st.limits.messages(msgs)
    tools = chat_tools(body.tools)
    hf = st.info.hf_tokenizer
    if hf is None:
        raise ApiError("this model has no tokenizer")
    kwargs = {**st.info.chat_template_kwargs, **(template_kwargs(body.thinking) or {})}
    try:
        ids = await asyncio.to_thread(render, hf, msgs, tools=msgspec.to_builtins(tools) if tools else None,
                                      kwargs=kwargs)
    except RequestError as e:
        raise ApiError(str(e), param="messages") from None
    return Response(msgspec.json.encode({"input_tokens": len(ids)}), media_type="application/json")
