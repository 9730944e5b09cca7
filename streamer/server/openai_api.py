"""/v1/completions, /v1/chat/completions (JSON or SSE), /v1/models and /v1/models/{model}.

The pipeline of both:
  bytes -> CompletionRequest | ChatCompletionRequest (protocol.decode_body), the fields
           OpenAI defines that this server refuses (fields.check_refused), the checks of
           fields that go together (check_completion | check_chat)
        -> the limits (limits.py)
        -> completion_requests | chat_requests: one engine request per choice, GenerateRequest
           with SamplingParams (protocol.to_sampling_params, the model's sampling defaults
           for what the body omits), ids f"{id}-{index}"
        -> ServerState.start: admitted once, submitted, run concurrently, merged back by
           choice index; the first output of every choice is awaited before any response
           starts (a request the engine refuses, say a prompt too long or a bad grammar,
           arrives as a first output with finish_reason "error" and must become a 400,
           which is no longer possible once a 200 stream has begun)
        -> one response (collect) or SSE chunks (events), openai_output.py.
A chat request without max_tokens goes to the engine with fill_context: the engine's
tokenizer gives it the room its prompt leaves (the server never applies the template).

echo (completions): each choice's text starts with its prompt (a token-id prompt decoded).
With logprobs, the engine reports the prompt's tokens, their logprobs and the top
alternatives at each (prompt_logprobs_from 1, prompt_top_logprobs). max_tokens 0 (only with echo) answers the prompt alone: the
engine runs the prompt with max_tokens 1, for its usage and logprobs, and the token it
samples is dropped (prompt_only): it cannot run a request that samples nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from streamer.chat_template import check_documents, check_kwargs, template_text, with_reasoning_effort
from streamer.errors import RequestError
from streamer.messages import GenerateRequest, GrammarSpec, RequestOutput, SamplingParams
from streamer.server import protocol as p
from streamer.server import responses as r
from streamer.server.chat_output import ChatSetup
from streamer.server.fields import CHAT_REFUSED, COMPLETION_REFUSED, MESSAGE_REFUSED, check_refused
from streamer.server.openai_output import (
    ChatChunks,
    CompletionChunks,
    Formatter,
    chat_choice,
    collect,
    events,
    joined,
    usage,
)
from streamer.server.protocol import ApiError
from streamer.server.sse_response import EventStream
from streamer.server.state import LORA, Merged, ServerState, until_disconnect

Policy = Callable[[SamplingParams], SamplingParams]
"""ServerState.apply_policy for one request's scope."""


def server(request: Request) -> ServerState:
    return request.app.state.server


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def card(st: ServerState, lora: str | None = None) -> r.ModelCard:
    """The served model's card, or a LoRA adapter's (its parent: the served model)."""
    if lora is not None:
        return r.ModelCard(lora, "model", st.started, "streamer", st.info.max_model_len, st.model_name)
    return r.ModelCard(st.model_name, "model", st.started, "streamer", st.info.max_model_len)


async def models(request: Request) -> Response:
    st = server(request)
    return json_response(r.ModelList("list", [card(st), *(card(st, name) for name in st.info.loras)]))


async def model(request: Request) -> Response:
    """One model's card; its folder's name is an alias of the served name (ServerState.serves)."""
    st = server(request)
    name = request.path_params["model"]
    st.check_model(name, request.scope)
    return json_response(card(st, request.scope.get(LORA)))


# ---- checks of fields that go together ---------------------------------------------


def check_stream_options(stream: bool, options: p.StreamOptions | None) -> None:
    if options is not None and not stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")


def check_completion(body: p.CompletionRequest) -> None:
    if body.echo and body.truncate_prompt_tokens is not None:
        raise ApiError("echo cannot be combined with truncate_prompt_tokens: the echoed prompt would not be the "
                       "one the model saw", param="truncate_prompt_tokens")
    if body.best_of not in (None, 1, body.n):
        raise ApiError(f"best_of {body.best_of} (the best n of several samples) is not supported: best_of may "
                       "only be 1 or equal n (n samples, all returned)", param="best_of",
                       code="unsupported_parameter")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError("max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens")
    check_prompt_logprobs(body.stream, body.prompt_logprobs)
    check_stream_options(body.stream, body.stream_options)


def check_chat(body: p.ChatCompletionRequest) -> None:
    if not body.messages:
        raise ApiError("messages must not be empty", param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise ApiError("continue_final_message continues the last message: it needs add_generation_prompt: "
                           "false", param="continue_final_message")
        if body.messages[-1].role != "assistant":
            raise ApiError("continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
    check_prompt_logprobs(body.stream, body.prompt_logprobs)
    check_stream_options(body.stream, body.stream_options)


def check_prompt_logprobs(stream: bool, prompt_logprobs: int | None) -> None:
    if prompt_logprobs is not None and stream:
        raise ApiError("prompt_logprobs is not supported with stream: true (ask without streaming)",
                       param="prompt_logprobs")


def with_prompt_logprobs(params: SamplingParams, top: int) -> SamplingParams:
    """The prompt's logprobs from its second token on, and the top this-many at each (or more, if
    asked already: echo's)."""
    return msgspec.structs.replace(params, prompt_logprobs_from=1,
                                   prompt_top_logprobs=max(top, params.prompt_top_logprobs))


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
    for i, m in enumerate(messages):
        if m.role == "function":
            raise ApiError("the function role is deprecated and not supported: use tool messages",
                           param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ApiError("only text content parts are supported", param="messages")
            content = "".join(part.text or "" for part in content)
        msg: dict[str, Any] = {"role": m.role, "content": content or m.refusal or ""}
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


def prediction_text(prediction: p.Prediction | None) -> str | None:
    """Predicted Outputs' content as text (its parts' texts joined)."""
    if prediction is None:
        return None
    if prediction.type != "content":
        raise ApiError(f"prediction type {prediction.type!r} is not supported (only content)", param="prediction.type")
    content = prediction.content
    if isinstance(content, str):
        return content
    if any(part.type != "text" for part in content):
        raise ApiError("prediction content parts must be text", param="prediction.content")
    return "".join(part.text or "" for part in content)


def request_template(st: ServerState, body: p.ChatFields) -> str:
    """The template that renders this chat: the request's own chat_template where the server
    trusts requests with one (--trust-request-chat-template; else refused by name), or the model's."""
    own = getattr(body, "chat_template", None)  # (chat completions only: not a WebSocket turn's)
    if own is None:
        return template_text(st.info.hf_tokenizer)
    if not st.config.trust_request_chat_template:
        raise ApiError("chat_template (a template in the request) is refused: this server runs only its own "
                       "templates unless started with --trust-request-chat-template", param="chat_template")
    return own


def chat_setup(st: ServerState, body: p.ChatFields,
               grammar: GrammarSpec | None) -> tuple[ChatSetup, dict[str, Any] | None]:
    """Tools, reasoning and the grammar of a chat body, against the server's parsers; and the
    request's own template variables (its chat_template_kwargs and reasoning_effort: the
    engine's tokenizer applies the server's defaults under them)."""
    try:
        mine = check_kwargs(body.chat_template_kwargs)
    except RequestError as e:
        raise ApiError(str(e), param="chat_template_kwargs") from None
    try:
        mine = with_reasoning_effort(request_template(st, body), body.reasoning_effort, mine)
    except RequestError as e:
        raise ApiError(str(e), param="reasoning_effort") from None
    setup = ChatSetup.of(
        tools=msgspec.to_builtins(body.tools) if body.tools else None,
        tool_choice=msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else None,
        parallel=body.parallel_tool_calls, grammar=grammar,
        template_kwargs={**st.info.chat_template_kwargs, **mine}, hf_tokenizer=st.info.hf_tokenizer,
        tool_parser=st.config.tool_call_parser, reasoning_parser=st.config.reasoning_parser)
    return setup, mine or None


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
                        policy: Policy, defaults: Mapping[str, float] | None = None) -> list[GenerateRequest]:
    """A completion body (its prompts parsed) -> one engine request per prompt and choice.
    With echo and logprobs, the prompt's logprobs are asked for (all but the first token's,
    which nothing predicts); max_tokens 0 runs one token, which respond() drops."""
    params = p.to_sampling_params(body, max_tokens=1 if body.max_tokens == 0 else body.max_tokens,
                                  logprobs=body.logprobs, vocab_size=vocab_size, defaults=defaults)
    if body.echo and body.logprobs is not None:
        params = with_prompt_logprobs(params, body.logprobs)
    if body.prompt_logprobs is not None:
        params = with_prompt_logprobs(params, body.prompt_logprobs)
    params = policy(params)
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
    params = p.to_sampling_params(body, max_tokens=body.max_completion_tokens or body.max_tokens, logprobs=top,
                                  vocab_size=st.info.vocab_size, fill_context=True, defaults=st.sampling_defaults)
    setup, kwargs = chat_setup(st, body, params.grammar)
    params = msgspec.structs.replace(params, grammar=setup.grammar, prediction=prediction_text(body.prediction),
                                     keep_special_tokens=list(setup.keep_special))
    if body.prompt_logprobs is not None:
        params = with_prompt_logprobs(params, body.prompt_logprobs)
    if body.documents is not None:
        try:
            check_documents(request_template(st, body), body.documents)
        except RequestError as e:
            raise ApiError(str(e), param="documents") from None
    params = policy(params)
    base = GenerateRequest(request_id=rid, messages=messages, params=params,
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           tools=msgspec.to_builtins(body.tools) if body.tools else None,
                           chat_template_kwargs=kwargs, documents=body.documents, chat_template=body.chat_template)
    return fan_out(base, rid, 0, body.n), setup


def echo_texts(st: ServerState, prompts: list[str | list[int]], n: int) -> list[str]:
    """Each choice's prompt as text (choice i is of prompt i // n; token ids decoded as they are)."""
    texts = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            hf = st.info.hf_tokenizer
            prompt = hf.decode(prompt, skip_special_tokens=False) if hf is not None else ""
        texts += [prompt] * n
    return texts


def prompt_only(out: RequestOutput) -> RequestOutput:
    """max_tokens 0: an output without the token the engine sampled (the prompt is the answer)."""
    if out.error is not None:
        return out
    return msgspec.structs.replace(out, token_ids=[], text="", logprobs=None, completion_tokens=0,
                                   finish_reason="length" if out.finished else None)


async def prompts_only(gen: Merged) -> Merged:
    try:
        async for i, out in gen:
            yield i, prompt_only(out)
    finally:
        await gen.aclose()


# ---- endpoints ---------------------------------------------------------------------


async def completions(request: Request) -> Response:
    st = server(request)
    data = await request.body()
    body: p.CompletionRequest = p.decode_body(data, p.CompletionRequest)
    check_refused(data, COMPLETION_REFUSED)
    st.check_model(body.model, request.scope)
    check_completion(body)
    st.limits.sampling(body)
    prompts = prompts_of(body.prompt)
    st.limits.batch(len(prompts) * body.n, "prompt", "engine requests (prompts x n)")
    st.limits.prompts(prompts, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    reqs = completion_requests(body, prompts, rid, st.info.vocab_size, lambda sp: st.apply_policy(sp, request.scope),
                               st.sampling_defaults)
    echo = echo_texts(st, prompts, body.n) if body.echo else None
    return await respond(request, st, reqs, rid, body.n, body.stream, body.stream_options, chat=None, echo=echo,
                         prompt_alone=body.max_tokens == 0, echo_top=body.logprobs,
                         prompt_top=body.prompt_logprobs, ids_as_tokens=body.return_tokens_as_token_ids)


async def chat_completions(request: Request) -> Response:
    st = server(request)
    data = await request.body()
    body: p.ChatCompletionRequest = p.decode_body(data, p.ChatCompletionRequest)
    check_refused(data, CHAT_REFUSED, MESSAGE_REFUSED)
    st.check_model(body.model, request.scope)
    check_chat(body)
    st.limits.sampling(body)
    messages = chat_messages(body.messages)
    st.limits.messages(messages)
    if body.prediction is not None:
        st.limits.prompts([prediction_text(body.prediction)], "prediction")
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    reqs, setup = chat_requests(body, messages, rid, st, lambda sp: st.apply_policy(sp, request.scope))
    return await respond(request, st, reqs, rid, body.n, body.stream, body.stream_options, chat=setup,
                         prompt_top=body.prompt_logprobs, ids_as_tokens=body.return_tokens_as_token_ids)


async def respond(request: Request, st: ServerState, reqs: list[GenerateRequest], rid: str, n: int,
                  stream: bool, options: p.StreamOptions | None, *, chat: ChatSetup | None,
                  echo: list[str] | None = None, prompt_alone: bool = False, echo_top: int | None = None,
                  prompt_top: int | None = None, ids_as_tokens: bool = False) -> Response:
    """chat: the chat request's setup (None for a completion). echo_top: a completion's logprobs (with
    echo, the echoed prompt's tokens have theirs; None: no logprobs); prompt_top: vLLM's
    prompt_logprobs (not streamed: check_prompt_logprobs); ids_as_tokens: return_tokens_as_token_ids."""
    gen, buffered = await st.start(reqs)  # admitted here, once
    if prompt_alone:
        gen, buffered = prompts_only(gen), [(i, prompt_only(out)) for i, out in buffered]
    fmt = Formatter(st, ids_as_tokens)
    created = int(time.time())
    if stream:
        chunks = ChatChunks(fmt, rid, created, st.answering(request.scope), chat) if chat is not None else \
            CompletionChunks(fmt, rid, created, st.answering(request.scope), echo, echo_top)
        usage_wanted = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        stream_events: AsyncIterator[bytes] = events(gen, buffered, chunks, n, len(reqs), usage_wanted, continuous)
        return EventStream(stream_events, sep="\n", shutdown_grace_period=20)
    choices = await until_disconnect(request, collect(gen, buffered, len(reqs)))
    if choices is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    ordered = sorted(choices.items())
    if chat is not None:
        answers = [chat_choice(i, c, chat, fmt) for i, c in ordered]  # (first: they count reasoning tokens)
        prompt_lps = fmt.vllm_prompt_logprobs(ordered[0][1], prompt_top) if prompt_top is not None else None
        return json_response(r.ChatCompletionResponse(
            rid, "chat.completion", created, st.answering(request.scope), usage=usage(choices, n, chat=True),
            choices=answers, prompt_logprobs=prompt_lps))
    out: list[r.CompletionChoice] = []
    for i, c in ordered:
        prefix = echo[i] if echo is not None else ""
        # (the prompt's logprobs first: the offsets start with it)
        lps = fmt.prompt_logprobs(c, echo_top) if echo is not None and echo_top is not None else None
        lps = joined(lps, fmt.completion_logprobs(c.logprobs, c))
        text = prefix + "".join(c.text)
        if prompt_top is None:
            out.append(r.CompletionChoice(i, text, lps, c.finish_reason))
        else:
            out.append(r.PromptCompletionChoice(i, text, lps, c.finish_reason, fmt.vllm_prompt_logprobs(c, prompt_top)))
    return json_response(r.CompletionResponse(rid, "text_completion", created, st.answering(request.scope),
                                              usage=usage(choices, n), choices=out))
