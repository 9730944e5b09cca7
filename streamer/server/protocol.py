"""Request bodies of the OpenAI-compatible API as msgspec Structs, and their one mapping to SamplingParams
(the answers: responses.py; the Responses API's own bodies: responses_api.py; errors: api_error.py).

Requests are decoded straight into these Structs, so a field of the wrong type
is refused by msgspec with the path of the field (which becomes the error's
`param`). Range constraints live in the annotations (`Meta`) so that they also
appear in the OpenAPI document that /openapi.json serves.

Every field OpenAI's API defines is implemented here, accepted without effect, or
refused with a 400 that names it: fields.py holds the refused ones and says, for each
accepted one, why it needs no effect on one server.

What is ignored, exactly:
  - keys that are neither OpenAI's nor this server's (its extensions are listed below),
    at the top of a body or inside its objects: client libraries' own keys and other
    servers' extensions that do not change the answer (request ids, hints). Clients send
    them freely, often by default for a whole family of servers, and refusing them would
    break those clients; the price is that a misspelt field goes unnoticed too. Other
    servers' extensions that would change the answer (vLLM's use_beam_search, SGLang's
    lora_path, ...) are refused unless they ask for the default (fields.py
    OTHER_SERVERS_REFUSED);
  - the OpenAI fields that need no effect on one server (fields.ACCEPTED, each with why);
  - for now, the tool fields that another part of the server will implement (tools,
    tool_choice, parallel_tool_calls, chat_template_kwargs, messages' tool_calls and
    tool_call_id): fields.py's docstring.
This server's own extensions of the OpenAI bodies: top_k, min_p, repetition_penalty,
allowed_token_ids, priority, min_tokens, ignore_eos, skip_special_tokens, stop_token_ids,
include_stop_str_in_output, bad_words, guided_json / regex / grammar / choice (and SGLang's names:
json_schema, regex, ebnf, no_stop_trim), cache_salt, timeout, prompt_logprobs and
return_tokens_as_token_ids (not on WebSocket turns), and for chat add_generation_prompt,
continue_final_message, documents and chat_template (--trust-request-chat-template).

An omitted temperature, top_p, top_k, repetition_penalty or min_p is the model's default
(its generation_config.json, unless `--generation-config none`), passed to
to_sampling_params as `defaults`; streamer's own defaults stand where it has none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct, field

from streamer.messages import MAX_CACHE_SALT, GrammarSpec, SamplingParams
from streamer.server.api_error import ApiError

# ---- requests ----------------------------------------------------------------

Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (its completion_tokens those generated yet)."""


class JsonSchemaFormat(Struct):
    name: str | None = None
    schema_: dict[str, Any] | None = field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    """structural_tag: xgrammar's structural tag format (tag, triggered_tags, sequence, ...)."""
    structures: list[dict[str, Any]] | None = None
    """structural_tag, vLLM's first form: [{"begin", "schema", "end"}], each begun by one of triggers."""
    triggers: list[str] | None = None


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
    bad_words: list[str] | None = None
    """vLLM's extension: words never to write (SamplingParams.bad_words; limited as stop strings)."""
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[int, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[int] | None = None
    """vLLM's extension: only these tokens may be sampled."""
    priority: int = 0
    """vLLM's extension: with --scheduling-policy priority, lower is served first."""
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """vLLM's extension: the stop string that ended a choice stays at the end of its text."""
    user: str | None = None
    response_format: ResponseFormat | str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    regex: str | None = None
    """SGLang's name for guided_regex."""
    ebnf: str | None = None
    """SGLang's name for guided_grammar."""
    json_schema: dict[str, Any] | str | None = None
    """SGLang's top-level JSON schema (guided_json)."""
    no_stop_trim: bool = False
    """SGLang's name for include_stop_str_in_output."""
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    """Prefix-cache namespace: cached prompt pages are shared only with requests of the same salt."""
    timeout: Annotated[float, Meta(gt=0.0)] | None = None
    """Seconds until the request ends with a timeout error (capped by --request-timeout)."""
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    """vLLM's extension: only the prompt's last this-many tokens (-1: the context's length)."""


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    """0 only with echo: the prompt alone (and with logprobs, its logprobs)."""
    logprobs: TopLogprobs | None = None
    """The top logprobs of each token (OpenAI's limit is 5; up to 20 here)."""
    echo: bool = False
    """The prompt precedes the completion in each choice's text (and logprobs)."""
    best_of: Annotated[int, Meta(ge=1)] | None = None
    """Accepted when 1 or equal to n (n samples, all returned); other values are refused."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: TopLogprobs | None = None
    """vLLM's extension: each choice's prompt_logprobs, the logprob and rank of every prompt token after the
    first and the top this-many at its position (openai_output.Formatter.vllm_prompt_logprobs)."""
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprobs name each token "token_id:{id}" (a token that is part of a character
    has no string of its own)."""


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
    refusal: str | None = None
    """An assistant's refusal, given back in the history: its content when it has none."""


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
    reasoning_effort: str | None = None
    """low | medium | high, for a template that reads it (chat_template.with_reasoning_effort)."""


class Prediction(Struct):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (SamplingParams.prediction)."""

    type: str
    content: str | list[ContentPart]


class ChatCompletionRequest(ChatFields, kw_only=True):
    messages: list[ChatMessage]
    prediction: Prediction | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's extension: the answer continues the last (assistant) message, which the template
    leaves open; needs add_generation_prompt false."""
    prompt_logprobs: TopLogprobs | None = None
    """vLLM's extension: the response's prompt_logprobs, over the prompt the template rendered
    (CompletionRequest.prompt_logprobs)."""
    return_tokens_as_token_ids: bool = False
    """As CompletionRequest.return_tokens_as_token_ids."""
    chat_template: str | None = None
    """vLLM's extension: a Jinja chat template that renders this request in place of the model's
    (the tool and reasoning parsers stay the server's); refused unless the server was started
    with --trust-request-chat-template."""
    documents: list[dict[str, str]] | None = None
    """vLLM's extension: retrieved documents (e.g. {"title", "text"}) for a template that reads
    `documents` (retrieval-augmented templates); refused where the template does not."""


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


def structural_tag_spec(rf: ResponseFormat) -> GrammarSpec:
    """response_format structural_tag: a format as it is, or vLLM's structures and triggers
    (text, until a trigger begins one of the structures, whose content follows its schema)."""
    fmt = rf.format
    if fmt is None:
        if rf.structures is None or rf.triggers is None:
            raise ApiError("response_format structural_tag needs format, or structures and triggers",
                           param="response_format")
        tags = []
        for i, s in enumerate(rf.structures):
            if not (isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                    and isinstance(s.get("schema"), dict | bool)):
                raise ApiError(f"response_format.structures[{i}] needs begin and end (strings) and schema",
                               param=f"response_format.structures[{i}]")
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": s["schema"]}})
        fmt = {"type": "triggered_tags", "triggers": rf.triggers, "tags": tags}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def response_format_spec(rf: ResponseFormat | str | None) -> GrammarSpec | None:
    kind = rf if isinstance(rf, str) else rf.type if rf is not None else "text"
    if kind == "structural_tag" and isinstance(rf, ResponseFormat):
        return structural_tag_spec(rf)
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
    body: SamplingFields, *, max_tokens: int | None, logprobs: int | None, vocab_size: int, fill_context: bool = False,
    defaults: Mapping[str, float] | None = None,
) -> SamplingParams:
    """The one mapping from an OpenAI body (or a WebSocket turn) to SamplingParams; n stays 1
    (the server fans out). fill_context: an omitted max_tokens means the room the prompt
    leaves in the context, which the engine's tokenizer resolves. defaults: the model's
    values (engine/generation_config.py) of the sampling fields the body omits. The engine
    validates the result (engine/tokenizer.py); here only what needs the body: the fields' names."""
    given = defaults or {}

    def pick(name: str, fallback: float) -> Any:
        value = getattr(body, name)
        return value if value is not None else given.get(name, fallback)

    bias = body.logit_bias or None
    if bias and any(not 0 <= t < vocab_size for t in bias):
        raise ApiError(f"logit_bias keys must be token ids in [0, {vocab_size})", param="logit_bias")
    allowed = body.allowed_token_ids
    if allowed is not None and (len(allowed) > vocab_size or any(not 0 <= t < vocab_size for t in allowed)):
        raise ApiError(f"allowed_token_ids must be at most {vocab_size} token ids in [0, {vocab_size})",
                       param="allowed_token_ids")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    grammar = grammar_of([
        response_format_spec(body.response_format),
        json_schema_spec(body.guided_json),
        None if body.guided_regex is None else GrammarSpec("regex", body.guided_regex),
        None if body.guided_grammar is None else GrammarSpec("ebnf", body.guided_grammar),
        choice_spec(body.guided_choice, "guided_choice", "guided_choice"),
        json_schema_spec(body.json_schema),
        None if body.regex is None else GrammarSpec("regex", body.regex),
        None if body.ebnf is None else GrammarSpec("ebnf", body.ebnf),
    ], "response_format, guided_json/regex/grammar/choice and SGLang's json_schema/regex/ebnf")
    return SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        fill_context=fill_context and max_tokens is None,
        min_tokens=body.min_tokens,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", -1)),
        min_p=pick("min_p", 0.0),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=pick("repetition_penalty", 1.0),
        logit_bias=bias,
        allowed_token_ids=allowed,
        priority=body.priority,
        seed=body.seed,
        stop=stop,
        include_stop=body.include_stop_str_in_output or body.no_stop_trim,
        stop_token_ids=list(body.stop_token_ids or []),
        bad_words=list(body.bad_words or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        grammar=grammar,
        cache_salt=body.cache_salt,
        timeout=body.timeout,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
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
