"""Every message that crosses an actor boundary, as msgspec Structs.

The actors share nothing else: a message is built by one actor, handed over
through an asyncio.Queue, and never mutated afterwards.

  caller ─Tokenize(GenerateRequest)─▶ tokenizer ─TokenizedRequest─▶ scheduler ─Batch─▶ executor
  scheduler ◀─StepOutput─ executor;  scheduler ─TokenBatch─▶ detokenizer ─RequestOutput─▶ caller
  detokenizer ─Finish─▶ scheduler (a stop string matched);  anyone ─Abort─▶ scheduler
  the engine ─LoraUpdate─▶ scheduler ─LoraUpdate─▶ executor (an adapter loaded or unloaded while serving)
  scheduler ◀─DraftsDrawn─ executor (a draft's proposals, before the step samples); MaskFill back
  the engine ─Shutdown─▶ each actor, in pipeline order, when it stops

What a request asks of its sampling (SamplingParams, GrammarSpec) is in streamer/sampling_params.py,
re-exported here. The frames between processes (server and engine, rank 0 and the other ranks) are in
streamer/frames.py; the scheduler's snapshot for whoever asks (EngineStats) in
streamer/engine_stats.py.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamer.sampling_params import MAX_CACHE_SALT as MAX_CACHE_SALT
from streamer.sampling_params import GrammarSpec as GrammarSpec
from streamer.sampling_params import SamplingParams as SamplingParams


class GenerateRequest(msgspec.Struct, kw_only=True):
    """What a caller submits: exactly one of prompt, prompt_token_ids, messages."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """messages end with an assistant message that the answer continues (rendered open:
    without its end-of-turn), instead of a new turn (then add_generation_prompt is false)."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools, rendered into the prompt by the chat template (with messages)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables of the chat template (e.g. enable_thinking), over the engine's defaults."""
    documents: list[dict[str, str]] | None = None
    """Documents for a chat template that reads them (retrieval-augmented: its `documents`)."""
    chat_template: str | None = None
    """A Jinja chat template that renders these messages in place of the model's."""


class Tokenize(msgspec.Struct):
    """Engine -> tokenizer: a new request (its outputs' queue is registered with the detokenizer)."""

    request: GenerateRequest
    arrival: float
    """time.monotonic() when the engine received it: its deadline (timeout) counts from here."""


class TokenizedRequest(msgspec.Struct, kw_only=True):
    """Tokenizer -> scheduler: validated token ids; params.max_tokens resolved (fill_context)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    grammar: Any = None
    """A compiled grammar (sampling.grammar.CompiledGrammar) or None."""
    arrival: float = 0.0
    """As Tokenize.arrival (the scheduler's deadline starts here; 0: at the scheduler)."""
    prediction: list[int] | None = None
    """params.prediction as token ids (ngram's proposals follow it; RequestOutput.prediction_token_ids)."""
    bad_words: list[list[int]] | None = None
    """params.bad_words as token sequences (engine/request.py Request.bans)."""


class Abort(msgspec.Struct, tag=True):
    """Stop a request wherever it is and free its pages. reason becomes finish_reason.
    (Tagged: it also crosses the socket to the engine process, see below.)"""

    request_id: str
    reason: str = "abort"


class Shutdown(msgspec.Struct):
    """To an actor's inbox: stop after what came before (AsyncEngine.stop sends one to each
    actor in pipeline order, so requests still open get their final output)."""


class LoraUpdate(msgspec.Struct):
    """The engine -> scheduler -> executor: serve `adapter` (model/lora.py Adapter) under `key`,
    or stop serving key's (adapter None). The scheduler first ends the requests of an adapter
    going away (their error names `name`, the adapter's name for users) and refuses any that
    arrive later; the executor changes the layers between steps, then resolves `done` (an
    asyncio.Future: None, or the ModelLoadError)."""

    key: str
    name: str
    adapter: Any
    done: Any
    path: str | None = None
    """The adapter's folder (tensor parallelism: the other ranks read it themselves)."""


class Finish(msgspec.Struct):
    """From the detokenizer: the request is complete (stop string), free it now."""

    request_id: str
    reason: str = "stop"


class SeqChunk(msgspec.Struct):
    """One sequence's share of a step: tokens [start, start+len(token_ids)) of it."""

    request_id: str
    token_ids: list[int]
    start: int
    page_table: list[int]
    sample: bool
    """True when this chunk ends at the sequence's last token, so a new token is drawn."""
    logprob_from: int = -1
    """Chunk index from which prompt logprobs are wanted (-1: none)."""
    logprob_targets: list[int] = msgspec.field(default_factory=list)
    """The next token of each such position, whose logprob is reported."""
    logprob_top: int = 0
    """And the top this-many tokens at each such position (SamplingParams.prompt_top_logprobs)."""
    num_draft: int = 0
    """Speculative decoding: the last num_draft tokens are proposals; the chunk samples at
    each of its last num_draft + 1 positions (a row each in the Batch's sampling lists)."""
    embed: bool = False
    """The chunk ends its embedding request's prompt: the final hidden state at its last
    position is wanted (StepOutput.embeddings)."""
    lora: str | None = None  # (SamplingParams.lora)


class Batch(msgspec.Struct):
    step: int
    seqs: list[SeqChunk]
    params: list[SamplingParams]
    """Sampling parameters of the sequences that sample, in order."""
    histories: list[list[int]]
    """Output token ids so far of the sampling sequences (penalties)."""
    banned: list[list[int]]
    """Per sampling sequence: token ids not allowed now (EOS before min_tokens)."""
    masks: Any = None
    """Grammar bitmask tensor [n_sampling, words] or None."""
    masks_deferred: bool = False
    """Scheduled while the step before it was in flight, with grammar rows: the matchers
    have not seen that step's tokens yet, so the bitmask follows in a MaskFill. The
    executor runs the forward meanwhile and samples when the MaskFill arrives."""
    spec: bool = False
    """Some sequence has proposals (SeqChunk.num_draft): the sampling lists have a row per
    sampled position, not per sequence."""
    masks_await_drafts: bool = False
    """With masks_deferred: a grammar request's verify chunk has draft_model proposals
    (PLACEHOLDERs): its rows' masks follow from the proposals, which the draft draws in this
    step. The executor sends them (DraftsDrawn) and the scheduler answers with the MaskFill."""


class DraftsDrawn(msgspec.Struct):
    """Executor -> scheduler: the proposals the draft drew in a step sent with
    masks_await_drafts, before that step's sampling (which waits for the MaskFill)."""

    step: int
    drafts: dict[str, list[int]]


class MaskFill(msgspec.Struct):
    """Scheduler -> executor: the grammar bitmask of a batch sent with masks_deferred,
    filled on the CPU after the previous step's tokens moved the matchers."""

    step: int
    masks: Any


class SampledToken(msgspec.Struct):
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class StepOutput(msgspec.Struct):
    step: int
    sampled: list[SampledToken]
    """One per sampling sequence of the batch, in order."""
    error: str | None = None
    prompt_logprobs: dict[str, list[float]] = msgspec.field(default_factory=dict)
    prompt_top_logprobs: dict[str, list[list[tuple[int, float]]]] = msgspec.field(default_factory=dict)
    """Per request that asked for them (SeqChunk.logprob_top), the top tokens at each of its
    prompt_logprobs' positions."""
    prompt_ranks: dict[str, list[int]] = msgspec.field(default_factory=dict)
    """Beside prompt_logprobs: each of those tokens' rank in the vocabulary (1: the most likely)."""
    drafts: dict[str, list[int]] = msgspec.field(default_factory=dict)
    """speculative draft_model: the proposals the draft drew for each verify chunk (sent as
    PLACEHOLDERs, model/draft.py)."""
    embeddings: dict[str, list[float]] = msgspec.field(default_factory=dict)
    """Per chunk with SeqChunk.embed: the final hidden state at its last position (float32)."""
    device_time: float = 0.0
    """Seconds the step took on the device, from its first work to its tokens' copy (on
    the CPU: the launch's wall time). The scheduler predicts decode steps' ends from it."""
    idle_before: float = 0.0
    """Seconds the device sat idle between the step before and this one (CUDA only): the
    host launched this one late."""
    mask_wait: float = 0.0
    """Of device_time, seconds the device sat idle between this step's forward and its
    sampling, waiting for grammar masks filled on the CPU (masks_deferred, CUDA only)."""
    host_times: dict[str, float] = msgspec.field(default_factory=dict)
    """time.perf_counter() of the step's host milestones in the executor: launch_begin,
    launch_end, sample_begin and sample_end (a deferred step's sampling), ready (its tokens
    reached the host); launch_cpu and sample_cpu: the CPU seconds of those calls (the rest
    of their wall time is waiting, mostly for the GIL). Read by the step trace
    (STREAMER_STEP_TRACE)."""


class TokenDelta(msgspec.Struct):
    """Scheduler -> detokenizer: new tokens of a request, possibly its end."""

    request_id: str
    token_ids: list[int]
    logprobs: list[SampledToken] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[float] | None = None
    queue_time: float | None = None
    """With the first delta: seconds from arrival at the scheduler to the first batch."""
    error_code: str | None = None
    """With error: RequestOutput.error_code (CONTEXT_LENGTH_EXCEEDED, from the tokenizer)."""
    prompt_token_ids: list[int] | None = None
    """With prompt_logprobs: RequestOutput.prompt_token_ids."""
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With prompt_logprobs: RequestOutput.prompt_top_logprobs."""
    prompt_ranks: list[int] | None = None
    """With prompt_logprobs: RequestOutput.prompt_ranks."""
    cached_host_tokens: int = 0
    """Of cached_tokens, those loaded back from the host tier (first delta)."""
    embedding: list[float] | None = None
    """SamplingParams.embed: the prompt's embedding (with its last delta, which has no tokens)."""
    prediction_token_ids: list[int] | None = None
    """First delta: RequestOutput.prediction_token_ids."""


class TokenBatch(msgspec.Struct):
    """Scheduler (one per step) or tokenizer -> detokenizer: the TokenDeltas of one step, in
    order; a request appears at most once with finish_reason set, in its last delta."""

    deltas: list[TokenDelta]


class RequestOutput(msgspec.Struct):
    """Detokenizer -> caller: one increment of a request's output."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[SampledToken] | None = None
    error: str | None = None
    prompt_logprobs: list[float] | None = None
    """Logprob of each prompt token from SamplingParams.prompt_logprobs_from on (first output)."""
    queue_time: float | None = None
    """First output only: seconds the request waited at the scheduler for its first batch."""
    error_code: str | None = None
    """With error, when the engine rather than the request failed: ENGINE_DOWN (it died) or
    ENGINE_STALLED (it stopped answering); CONTEXT_LENGTH_EXCEEDED: the request's prompt and
    max_tokens do not fit the context. None: another error of the request's own, or an internal
    one ("internal error: ..."). (A deadline is finish_reason "timeout", with an error message.)"""
    prompt_token_ids: list[int] | None = None
    """With prompt_logprobs (first output): the prompt's token ids, as the engine tokenized it
    (what OpenAI's echo reports the logprobs of)."""
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With prompt_logprobs and SamplingParams.prompt_top_logprobs: the top (id, logprob) at
    each of their positions."""
    prompt_ranks: list[int] | None = None
    """With prompt_logprobs: each of those tokens' rank in the vocabulary at its position (1: the
    most likely; vLLM's prompt_logprobs report it)."""
    cached_host_tokens: int = 0
    """Of cached_tokens, those whose KV came back from the host tier (--host-kv-cache-gb); the
    rest were on the device."""
    embedding: list[float] | None = None
    """SamplingParams.embed: the prompt's embedding (the final output; no tokens, no text)."""
    stop: str | None = None
    """The stop string (of SamplingParams.stop) that ended the request, with finish_reason "stop"."""
    prediction_token_ids: list[int] | None = None
    """First output: SamplingParams.prediction as tokens (usage's accepted/rejected prediction tokens)."""


ENGINE_DOWN = "engine_down"
ENGINE_STALLED = "engine_stalled"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class Register(msgspec.Struct):
    """Engine -> detokenizer, before the request enters the tokenizer: where its outputs go."""

    request_id: str
    params: SamplingParams
    queue: Any
    """Where its outputs go (put_nowait): the caller's asyncio.Queue[RequestOutput], or a
    sink shared by many requests (AsyncEngine.enqueue; the engine process's outbox)."""


# What each actor's inbox carries (the tokenizer's: Tokenize | Shutdown).
ToScheduler = TokenizedRequest | StepOutput | DraftsDrawn | Abort | Finish | LoraUpdate | Shutdown
ToExecutor = Batch | MaskFill | LoraUpdate | Shutdown
ToDetokenizer = Register | TokenBatch | Shutdown
