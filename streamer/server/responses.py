"""Wire bodies of the OpenAI-compatible API's answers, as msgspec Structs: completions, chat
completions (whole and streamed chunks) and the model list. The requests and their one
mapping to SamplingParams are in protocol.py. Also the Responses API's response, its items
and usage (/v1/responses: responses_api.py)."""

from __future__ import annotations

from typing import Any

from msgspec import Struct, field

from streamer.server.protocol import ToolCallItem  # (an answer's calls have the history's shape)


class PromptTokensDetails(Struct):
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    """Of cached_tokens, those loaded back from the host tier (--host-kv-cache-gb)."""


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0
    """Of completion_tokens, those of the reasoning (--reasoning-parser; chat only)."""
    accepted_prediction_tokens: int = 0
    """With a prediction (Predicted Outputs): its tokens the completion has (openai_output.predicted)."""
    rejected_prediction_tokens: int = 0
    """...and those it has not (0 without a prediction, as OpenAI reports them)."""


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None
    """Chat's (completions have none)."""


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


class PromptLogprob(Struct):
    """vLLM's Logprob: a token's logprob at a prompt position, its rank in the vocabulary there
    (1: the most likely) and its text decoded alone."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: None for the first prompt token (nothing predicts it), then per token a
dict by token id (as a string) of that token and the top ones at its position."""


class PromptCompletionChoice(CompletionChoice):
    """A choice of a request that asked for prompt_logprobs (vLLM's extension)."""

    prompt_logprobs: PromptLogprobs | None = None


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
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's extension (ChatCompletionRequest.prompt_logprobs), of the prompt the template rendered."""


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


class ModelCard(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's field)."""


class ModelList(Struct):
    object: str
    data: list[ModelCard]


# ---- the Responses API (/v1/responses) -------------------------------------------------


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[dict] = []
    logprobs: list[TokenLogprob] = []
    """With include ["message.output_text.logprobs"] or top_logprobs: every token's (else empty)."""


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(Struct, tag_field="type", tag="message"):
    id: str
    status: str
    """completed, or incomplete when the answer was cut (max_output_tokens)."""
    role: str
    content: list[OutputText]


class ReasoningItem(Struct, tag_field="type", tag="reasoning"):
    id: str
    summary: list[dict]
    """Always empty: the reasoning is given whole, in content."""
    content: list[ReasoningText]
    status: str


class FunctionCallItem(Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str


class ResponseError(Struct):
    code: str
    message: str


class ResponseObject(Struct):
    """A response: the answer to a POST /v1/responses, and what its stream's lifecycle
    events carry (status in_progress, then completed, incomplete or failed)."""

    id: str
    created_at: int
    status: str
    model: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    top_logprobs: int
    tool_choice: Any
    tools: list[Any]
    text: Any
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    object: str = "response"
    previous_response_id: str | None = None
    reasoning: dict = field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    background: bool = False
    truncation: str = "disabled"
    service_tier: str = "default"
