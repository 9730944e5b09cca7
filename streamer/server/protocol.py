"""Wire bodies of the OpenAI-compatible API as msgspec Structs, and their one mapping to SamplingParams.

Requests are decoded straight into these Structs, so a field of the wrong type
is refused by msgspec with the path of the field (which becomes the error's
`param`). Range constraints live in the annotations (`Meta`) so that they also
appear in the OpenAPI document that /openapi.json serves.

Unknown fields are ignored, as most OpenAI-compatible servers do: clients
send vendor extensions freely and a strict server would break them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct, field

from streamer.messages import MAX_CACHE_SALT, GrammarSpec, SamplingParams

# ---- errors ------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


# ---- requests ----------------------------------------------------------------

Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(Struct):
    include_usage: bool = False


class JsonSchemaFormat(Struct):
    name: str | None = None
    schema_: dict[str, Any] | None = field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True):
    """Fields shared by completions, chat completions and WebSocket turns."""

    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Prob | None = None
    n: Annotated[int, Meta(ge=1)] = 1  # at most --max-n (server/limits.py)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[int, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: ResponseFormat | str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    """Prefix-cache namespace: cached prompt pages are shared only with requests of the same salt."""
    timeout: Annotated[float, Meta(gt=0.0)] | None = None
    """Seconds until the request ends with a timeout error (capped by --request-timeout)."""


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCall(Struct):
    name: str
    arguments: str
    """A JSON object as a string, as OpenAI sends and answers it."""


class ToolCallItem(Struct):
    """A call in an assistant message: in the history (request) and in the answer."""

    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """An earlier answer's reasoning: passed to the template, which keeps or drops it."""


class FunctionDef(Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted; the arguments of a constrained call always follow `parameters`."""


class Tool(Struct):
    type: str
    function: FunctionDef


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct):
    type: str
    function: FunctionName


class ChatFields(SamplingFields, kw_only=True):
    """Fields shared by chat completions and WebSocket turns: tools and the template."""

    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    """none | auto | required | {"type": "function", "function": {"name"}}; default auto with tools."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ChatFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True


# ---- responses ---------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Struct, omit_defaults=True):
    """Also the streamed chunk (usage is left out of chunks that carry none)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None


class AssistantMessage(Struct, omit_defaults=True):
    role: str
    content: str | None  # (no default: null is sent when the answer is only tool calls)
    tool_calls: list[ToolCallItem] | None = None
    reasoning_content: str | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """OpenAI's streamed call: index, id, type and name first, then argument fragments."""

    index: int
    function: DeltaFunction
    id: str | None = None
    type: str | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Struct):
    object: str
    data: list[ModelCard]


# ---- mapping -----------------------------------------------------------------

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions (chat and WebSocket turns fill the context instead)."""


def grammar_of(specs: list[GrammarSpec | None], names: str) -> GrammarSpec | None:
    """The one output constraint among a body's grammar fields (each field's spec, or None
    where it is absent): more than one is refused, naming the fields (`names`)."""
    given = [g for g in specs if g is not None]
    if len(given) > 1:
        raise ApiError(f"give at most one of {names}")
    return given[0] if given else None


def json_schema_spec(schema: str | dict[str, Any] | None) -> GrammarSpec | None:
    """A JSON schema given as an object or as its text."""
    if schema is None:
        return None
    return GrammarSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def choice_spec(choices: list[str] | None, name: str, param: str | None) -> GrammarSpec | None:
    if choices is None:
        return None
    if not choices:
        raise ApiError(f"{name} needs at least one choice", param=param)
    return GrammarSpec("choice", json.dumps(choices))


def response_format_spec(rf: ResponseFormat | str | None) -> GrammarSpec | None:
    kind = rf if isinstance(rf, str) else rf.type if rf is not None else "text"
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = rf.json_schema if isinstance(rf, ResponseFormat) else None
        if js is None or js.schema_ is None:
            raise ApiError("response_format json_schema needs json_schema.schema", param="response_format")
        return GrammarSpec("json_schema", json.dumps(js.schema_))
    if kind != "text":
        raise ApiError(f"unknown response_format type {kind!r}", param="response_format")
    return None


def to_sampling_params(
    body: SamplingFields, *, max_tokens: int | None, logprobs: int | None, vocab_size: int, fill_context: bool = False
) -> SamplingParams:
    """The one mapping from an OpenAI body (or a WebSocket turn) to SamplingParams; n stays 1
    (the server fans out). fill_context: an omitted max_tokens means the room the prompt
    leaves in the context, which the engine's tokenizer resolves. The engine validates the
    result (engine/tokenizer.py); here only what needs the body: the fields' names."""
    bias = body.logit_bias or None
    if bias and any(not 0 <= t < vocab_size for t in bias):
        raise ApiError(f"logit_bias keys must be token ids in [0, {vocab_size})", param="logit_bias")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    grammar = grammar_of([
        response_format_spec(body.response_format),
        json_schema_spec(body.guided_json),
        None if body.guided_regex is None else GrammarSpec("regex", body.guided_regex),
        None if body.guided_grammar is None else GrammarSpec("ebnf", body.guided_grammar),
        choice_spec(body.guided_choice, "guided_choice", "guided_choice"),
    ], "response_format, guided_json/regex/grammar/choice")
    return SamplingParams(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        fill_context=fill_context and max_tokens is None,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=bias,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        grammar=grammar,
        cache_salt=body.cache_salt,
        timeout=body.timeout,
    )


def decode_body(data: bytes, kind: type[Any]) -> Any:
    """Bytes -> Struct; msgspec's errors become 400s that name the field."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0] if "at `$." in msg else None
        raise ApiError(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the body nests too deeply") from None


def openapi_document(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 from the Structs' JSON schemas (the fuzzing tests read it)."""
    kinds = [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse,
             ModelList, ErrorResponse]
    (req_c, req_ch, res_c, res_ch, models, err), comps = msgspec.json.schema_components(
        kinds, ref_template="#/components/schemas/{name}"
    )
    errors = {str(s): {"description": d, "content": {"application/json": {"schema": err}}}
              for s, d in ((400, "invalid request"), (401, "missing or wrong API key"),
                           (503, "queue full, shutting down, or the engine down or not responding"),
                           (504, "the request's deadline passed (timeout, --request-timeout)"))}

    def post(req: dict, res: dict, summary: str) -> dict:
        ok = {"description": "a response, or an SSE stream of chunks when stream is true",
              "content": {"application/json": {"schema": res}, "text/event-stream": {"schema": {"type": "string"}}}}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": req}}}, "responses": {"200": ok, **errors}}}

    def get(summary: str, schema: dict | None = None, media: str = "application/json") -> dict:
        content = {media: {"schema": schema or {"type": "string" if media != "application/json" else "object"}}}
        return {"get": {"summary": summary, "responses": {"200": {"description": "ok", "content": content}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "streamer", "version": version},
        "paths": {
            "/v1/completions": post(req_c, res_c, "Text completion"),
            "/v1/chat/completions": post(req_ch, res_ch, "Chat completion"),
            "/v1/models": get("Served models", models),
            "/health": get("200 while the engine serves; 503 when it is down or stalled (no heartbeat)"),
            "/metrics": get("Prometheus metrics", media="text/plain"),
        },
        "components": {"schemas": comps},
    }
