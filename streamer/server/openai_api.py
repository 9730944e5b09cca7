"""/v1/completions, /v1/chat/completions (JSON or SSE) and /v1/models.

The pipeline of both:
  bytes -> CompletionRequest | ChatCompletionRequest (protocol.decode_body)
        -> the limits (limits.py)
        -> completion_requests | chat_requests: one engine request per choice, GenerateRequest
           with SamplingParams (protocol.to_sampling_params), ids f"{id}-{index}"
        -> ServerState.start: admitted once, submitted, run concurrently, merged back by
           choice index; the first output of every choice is awaited before any response
           starts (a request the engine refuses, say a prompt too long or a bad grammar,
           arrives as a first output with finish_reason "error" and must become a 400,
           which is no longer possible once a 200 stream has begun)
        -> one response (collect) or SSE chunks (events: CompletionChunks | ChatChunks).
A chat request without max_tokens goes to the engine with fill_context: the engine's
tokenizer gives it the room its prompt leaves (the server never applies the template).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from streamer.chat_template import check_kwargs
from streamer.errors import RequestError
from streamer.messages import GenerateRequest, GrammarSpec, RequestOutput, SampledToken, SamplingParams
from streamer.server import protocol as p
from streamer.server.chat_output import ChatDelta, ChatOutput, ChatSetup, finish_reason
from streamer.server.protocol import ApiError
from streamer.server.sse_response import EventStream
from streamer.server.state import Merged, ServerState, failure, until_disconnect
from streamer.sse import DONE_EVENT, data_event

Policy = Callable[[SamplingParams], SamplingParams]
"""ServerState.apply_policy for one request's scope."""


def server(request: Request) -> ServerState:
    return request.app.state.server


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


async def models(request: Request) -> Response:
    st = server(request)
    card = p.ModelCard(st.model_name, "model", int(time.time()), "streamer", st.info.max_model_len)
    return json_response(p.ModelList("list", [card]))


# ---- request -> engine requests --------------------------------------------------


def prompts_of(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError("prompt must not be empty", param="prompt")
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    if all(isinstance(x, list) for x in prompt):
        return list(prompt)
    raise ApiError("prompt must be a string, a list of strings, token ids, or a list of token-id lists",
                   param="prompt")


def chat_messages(messages: list[p.ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ApiError("only text content parts are supported", param="messages")
            content = "".join(part.text or "" for part in content)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def chat_setup(st: ServerState, body: p.ChatFields, grammar: GrammarSpec | None) -> ChatSetup:
    """Tools, reasoning and the grammar of a chat body, against the server's parsers."""
    try:
        mine = check_kwargs(body.chat_template_kwargs)
    except RequestError as e:
        raise ApiError(str(e), param="chat_template_kwargs") from None
    return ChatSetup.of(
        tools=msgspec.to_builtins(body.tools) if body.tools else None,
        tool_choice=msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else None,
        parallel=body.parallel_tool_calls, grammar=grammar,
        template_kwargs={**st.info.chat_template_kwargs, **mine}, hf_tokenizer=st.info.hf_tokenizer,
        tool_parser=st.config.tool_call_parser, reasoning_parser=st.config.reasoning_parser)


def fan_out(base: GenerateRequest, rid: str, first_index: int, n: int) -> list[GenerateRequest]:
    """n copies of a request, ids f"{rid}-{index}", seed + index when seeded."""
    reqs = []
    for index in range(first_index, first_index + n):
        params = base.params
        if params.seed is not None:
            params = msgspec.structs.replace(params, seed=params.seed + index)
        reqs.append(msgspec.structs.replace(base, request_id=f"{rid}-{index}", params=params))
    return reqs


def completion_requests(body: p.CompletionRequest, prompts: list[str | list[int]], rid: str, vocab_size: int,
                        policy: Policy) -> list[GenerateRequest]:
    """A completion body (its prompts parsed) -> one engine request per prompt and choice."""
    params = policy(p.to_sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                         vocab_size=vocab_size))
    reqs = []
    for k, prompt in enumerate(prompts):
        base = (GenerateRequest(request_id=rid, prompt=prompt, params=params) if isinstance(prompt, str)
                else GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params))
        reqs += fan_out(base, rid, k * body.n, body.n)
    return reqs


def chat_requests(body: p.ChatCompletionRequest, messages: list[dict[str, Any]], rid: str, st: ServerState,
                  policy: Policy) -> tuple[list[GenerateRequest], ChatSetup]:
    """A chat body (its messages flattened) -> one engine request per choice, and what its
    output needs (tool calls, reasoning); without max_tokens, each may fill the context
    (resolved by the engine's tokenizer)."""
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = p.to_sampling_params(body, max_tokens=body.max_completion_tokens or body.max_tokens,
                                  logprobs=top, vocab_size=st.info.vocab_size, fill_context=True)
    setup = chat_setup(st, body, params.grammar)
    params = policy(msgspec.structs.replace(params, grammar=setup.grammar))
    base = GenerateRequest(request_id=rid, messages=messages, params=params,
                           add_generation_prompt=body.add_generation_prompt,
                           tools=msgspec.to_builtins(body.tools) if body.tools else None,
                           chat_template_kwargs=body.chat_template_kwargs)
    return fan_out(base, rid, 0, body.n), setup


# ---- outputs -> OpenAI shapes ------------------------------------------------------


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    offset: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.logprobs.extend(out.logprobs or [])
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error, self.error_code = out.error, out.error_code


def usage(choices: dict[int, Choice], n: int) -> p.Usage:
    """Prompt tokens count once per prompt (choice index // n), completions for every choice."""
    firsts = [c for i, c in choices.items() if i % n == 0]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices.values())
    return p.Usage(prompt, completion, prompt + completion,
                   p.PromptTokensDetails(sum(c.cached_tokens for c in firsts)))


class Formatter:
    """Token strings for logprobs (decoded one token at a time, as OpenAI reports them)."""

    def __init__(self, st: ServerState) -> None:
        self.tok = st.info.hf_tokenizer

    def token(self, tid: int) -> str:
        return self.tok.decode([tid]) if self.tok is not None else str(tid)

    def completion_logprobs(self, lps: list[SampledToken], c: Choice) -> p.CompletionLogprobs | None:
        if not lps:
            return None
        tokens = [self.token(t.token_id) for t in lps]
        offsets = []
        for s in tokens:
            offsets.append(c.offset)
            c.offset += len(s)
        tops = [{self.token(i): lp for i, lp in t.top_logprobs} if t.top_logprobs is not None else None
                for t in lps]
        return p.CompletionLogprobs(tokens, [t.logprob for t in lps], tops, offsets)

    def chat_logprobs(self, lps: list[SampledToken]) -> p.ChoiceLogprobs | None:
        if not lps:
            return None
        content = []
        for t in lps:
            s = self.token(t.token_id)
            tops = [p.TopLogprob(self.token(i), lp, list(self.token(i).encode())) for i, lp in t.top_logprobs or []]
            content.append(p.TokenLogprob(s, t.logprob if t.logprob is not None else 0.0, list(s.encode()), tops))
        return p.ChoiceLogprobs(content)


# ---- endpoints ---------------------------------------------------------------------


async def completions(request: Request) -> Response:
    st = server(request)
    body: p.CompletionRequest = p.decode_body(await request.body(), p.CompletionRequest)
    st.check_model(body.model)
    if body.echo:
        raise ApiError("echo is not supported", param="echo")
    st.limits.sampling(body)
    prompts = prompts_of(body.prompt)
    st.limits.batch(len(prompts) * body.n, "prompt", "engine requests (prompts x n)")
    st.limits.prompts(prompts, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    reqs = completion_requests(body, prompts, rid, st.info.vocab_size, lambda sp: st.apply_policy(sp, request.scope))
    return await respond(request, st, reqs, rid, body.n, body.stream, body.stream_options, chat=None)


async def chat_completions(request: Request) -> Response:
    st = server(request)
    body: p.ChatCompletionRequest = p.decode_body(await request.body(), p.ChatCompletionRequest)
    st.check_model(body.model)
    if not body.messages:
        raise ApiError("messages must not be empty", param="messages")
    st.limits.sampling(body)
    messages = chat_messages(body.messages)
    st.limits.messages(messages)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    reqs, setup = chat_requests(body, messages, rid, st, lambda sp: st.apply_policy(sp, request.scope))
    return await respond(request, st, reqs, rid, body.n, body.stream, body.stream_options, chat=setup)


async def respond(request: Request, st: ServerState, reqs: list[GenerateRequest], rid: str, n: int,
                  stream: bool, options: p.StreamOptions | None, *, chat: ChatSetup | None) -> Response:
    """chat: the chat request's setup (None for a completion)."""
    gen, buffered = await st.start(reqs)  # admitted here, once
    fmt = Formatter(st)
    created = int(time.time())
    if stream:
        chunks = ChatChunks(fmt, rid, created, st.model_name, chat) if chat is not None else \
            CompletionChunks(fmt, rid, created, st.model_name)
        usage_wanted = bool(options and options.include_usage)
        return EventStream(events(gen, buffered, chunks, n, len(reqs), usage_wanted), sep="\n",
                           shutdown_grace_period=20)
    choices = await until_disconnect(request, collect(gen, buffered, len(reqs)))
    if choices is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    ordered = sorted(choices.items())
    if chat is not None:
        return json_response(p.ChatCompletionResponse(
            rid, "chat.completion", created, st.model_name, usage=usage(choices, n),
            choices=[chat_choice(i, c, chat, fmt) for i, c in ordered]))
    return json_response(p.CompletionResponse(
        rid, "text_completion", created, st.model_name, usage=usage(choices, n),
        choices=[p.CompletionChoice(i, "".join(c.text), fmt.completion_logprobs(c.logprobs, c), c.finish_reason)
                 for i, c in ordered]))


def chat_choice(i: int, c: Choice, setup: ChatSetup, fmt: Formatter) -> p.ChatChoice:
    text = "".join(c.text)
    lps = fmt.chat_logprobs(c.logprobs)
    if setup.tools is None and setup.reasoning is None:
        return p.ChatChoice(i, p.AssistantMessage("assistant", text), lps, c.finish_reason)
    out = setup.output()
    parsed = out.parse(text)
    calls = [p.ToolCallItem(k.id, p.FunctionCall(k.name, k.arguments)) for k in parsed.calls]
    msg = p.AssistantMessage("assistant", parsed.content if parsed.content or not calls else None,
                             calls or None, parsed.reasoning)
    return p.ChatChoice(i, msg, lps, finish_reason(c.finish_reason, out.called))


async def collect(gen: Merged, buffered: list[tuple[int, RequestOutput]], count: int) -> dict[int, Choice]:
    choices = {i: Choice() for i in range(count)}
    try:
        for i, out in buffered:
            choices[i].add(out)
        async for i, out in gen:
            choices[i].add(out)
    finally:
        await gen.aclose()
    for c in choices.values():
        if c.finish_reason in ("error", "timeout"):
            raise failure(c)
    return choices


# ---- SSE -----------------------------------------------------------------------------


class CompletionChunks:
    def __init__(self, fmt: Formatter, rid: str, created: int, model: str) -> None:
        self.fmt, self.head = fmt, (rid, "text_completion", created, model)

    def encode(self, *choices: p.CompletionChoice, use: p.Usage | None = None) -> bytes:
        return data_event(p.CompletionResponse(*self.head, choices=list(choices), usage=use))

    def opening(self, count: int) -> list[bytes]:
        return []

    def content(self, i: int, out: RequestOutput, c: Choice) -> bytes:
        return self.encode(p.CompletionChoice(i, out.text, self.fmt.completion_logprobs(out.logprobs or [], c)))

    def finish(self, i: int, reason: str | None) -> bytes:
        return self.encode(p.CompletionChoice(i, "", None, reason))


class ChatChunks:
    """With tools or reasoning, each choice's text goes through its ChatOutput: markup held
    back until decided, reasoning and calls in their own delta fields."""

    def __init__(self, fmt: Formatter, rid: str, created: int, model: str, setup: ChatSetup) -> None:
        self.fmt, self.head = fmt, (rid, "chat.completion.chunk", created, model)
        self.plain = setup.tools is None and setup.reasoning is None
        self.setup = setup
        self.outputs: dict[int, ChatOutput] = {}

    def output(self, i: int) -> ChatOutput:
        if i not in self.outputs:
            self.outputs[i] = self.setup.output()
        return self.outputs[i]

    @staticmethod
    def delta(d: ChatDelta) -> p.Delta:
        calls = [p.DeltaToolCall(k.index, p.DeltaFunction(k.name, k.arguments if k.name is None else k.arguments or ""),
                                 k.id, "function" if k.id is not None else None) for k in d.calls]
        return p.Delta(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)

    def encode(self, *choices: p.ChatChunkChoice, use: p.Usage | None = None) -> bytes:
        return data_event(p.ChatCompletionChunk(*self.head, choices=list(choices), usage=use))

    def opening(self, count: int) -> list[bytes]:
        return [self.encode(p.ChatChunkChoice(i, p.Delta(role="assistant", content=""))) for i in range(count)]

    def content(self, i: int, out: RequestOutput, c: Choice) -> bytes:
        lps = self.fmt.chat_logprobs(out.logprobs or [])
        if self.plain:
            return self.encode(p.ChatChunkChoice(i, p.Delta(content=out.text), lps))
        d = self.output(i).feed(out.text)
        if not d and lps is None:
            return b""  # (all held back: markup not decided yet)
        return self.encode(p.ChatChunkChoice(i, self.delta(d), lps))

    def finish(self, i: int, reason: str | None) -> bytes:
        if self.plain:
            return self.encode(p.ChatChunkChoice(i, p.Delta(), None, reason))
        out = self.output(i)
        d = out.finish()
        last = self.encode(p.ChatChunkChoice(i, p.Delta(), None, finish_reason(reason, out.called)))
        return (self.encode(p.ChatChunkChoice(i, self.delta(d))) if d else b"") + last


async def events(gen: Merged, buffered: list[tuple[int, RequestOutput]], chunks: CompletionChunks | ChatChunks,
                 n: int, count: int, usage_wanted: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunk order: [role], content deltas, a finish chunk per choice, [usage], [DONE].

    A failure after the stream began cannot change the status any more: it is
    sent as an {"error": ...} event before [DONE].

    The events of one engine output leave in one write (one send, one syscall): the role
    chunk with the first content, the last content with its finish chunk, the usage and
    [DONE].
    """
    choices = {i: Choice() for i in range(count)}
    pending: list[bytes] = chunks.opening(count)
    left = count
    failed = False

    def take(i: int, out: RequestOutput) -> bool:
        """Queue the events of one output; True once nothing more is to be sent before the end."""
        nonlocal left, failed
        choices[i].add(out)
        if out.error:
            if out.finish_reason == "timeout":  # what was generated stands: its end, then why
                if out.text or out.logprobs:
                    pending.append(chunks.content(i, out, choices[i]))
                pending.append(chunks.finish(i, out.finish_reason))
            pending.append(data_event(failure(out).body()))
            failed = True
            return True
        if out.text or out.logprobs:
            pending.append(chunks.content(i, out, choices[i]))
        if out.finished:
            pending.append(chunks.finish(i, out.finish_reason))
            left -= 1
        return left == 0

    def flush() -> bytes:
        pending[:] = [x for x in pending if x]  # (a chunk of held-back text is b"")
        if not pending:
            return b""
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        return data

    try:
        done = any(take(i, out) for i, out in buffered)  # (the first outputs, already here)
        if not done and pending and (data := flush()):
            yield data
        if not failed:
            async for i, out in gen:
                # once every choice has finished nothing more comes: the loop only waits for
                # the generator's end, and the last events leave with [DONE]
                if not done:
                    done = take(i, out)
                    if failed:
                        break
                    if not done and pending and (data := flush()):
                        yield data
        if not failed and usage_wanted:
            pending.append(chunks.encode(use=usage(choices, n)))
        pending.append(DONE_EVENT)
        yield b"".join(pending)
    finally:
        await gen.aclose()
