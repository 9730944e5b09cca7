"""Wire bodies of the OpenAI-compatible API's answers, as msgspec Structs: completions, chat
completions (whole and streamed chunks) and the model list. The requests and their one
mapping to SamplingParams are in protocol.py."""

from __future__ import annotations

from msgspec import Struct

from streamer.server.protocol import ToolCallItem  # (an answer's calls have the history's shape)


class PromptTokensDetails(Struct):
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    """Of cached_tokens, those loaded back from the host tier (--host-kv-cache-gb)."""


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
