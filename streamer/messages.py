"""Every message that crosses an actor boundary, as msgspec Structs.

The actors share nothing else: a message is built by one actor, handed over
through an asyncio.Queue, and never mutated afterwards.

  caller ─Tokenize(GenerateRequest)─▶ tokenizer ─TokenizedRequest─▶ scheduler ─Batch─▶ executor
  scheduler ◀─StepOutput─ executor;  scheduler ─TokenBatch─▶ detokenizer ─RequestOutput─▶ caller
  detokenizer ─Finish─▶ scheduler (a stop string matched);  anyone ─Abort─▶ scheduler
  scheduler ◀─DraftsDrawn─ executor (a draft's proposals, before the step samples); MaskFill back
  the engine ─Shutdown─▶ each actor, in pipeline order, when it stops

The frames between processes (server and engine, rank 0 and the other ranks) are in
streamer/frames.py; the scheduler's snapshot for whoever asks (EngineStats) in
streamer/engine_stats.py.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from streamer.errors import RequestError

MAX_CACHE_SALT = 1024


class GrammarSpec(msgspec.Struct, frozen=True):
    """A constraint on the output. kind: json_object | json_schema | regex | ebnf | choice |
    structural_tag (sampling/grammar.py says what each value holds)."""

    kind: str
    value: str = ""


class SamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: int = 16
    fill_context: bool = False
    """max_tokens is the room the prompt leaves: min(max_model_len, the KV pool's tokens) minus
    the prompt's tokens, set by the tokenizer actor once it knows the prompt's length (a prompt
    that leaves none is refused). What OpenAI's chat API and WebSocket turns do when max_tokens
    is omitted; the max_tokens given alongside is ignored."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    priority: int = 0
    """With EngineConfig.scheduling_policy priority: lower is scheduled first (vLLM's)."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these tokens may be sampled (every other logit -inf, after bias and penalties)."""
    seed: int | None = None
    n: int = 1
    stop: list[str] = msgspec.field(default_factory=list)
    include_stop: bool = False
    """The stop string that ended the request stays at the end of its text (vLLM's
    include_stop_str_in_output); by default it is cut."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    bad_words: list[str] = msgspec.field(default_factory=list)
    """vLLM's: words never to write. Each is tokenized alone and after a space (TokenizedRequest.bad_words);
    a tokenization's last token is banned wherever the output so far ends with the rest of it (a
    one-token word: always)."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top logprobs to return per token (0: only the sampled one)."""
    skip_special_tokens: bool = True
    keep_special_tokens: list[str] = msgspec.field(default_factory=list)
    """With skip_special_tokens: special tokens whose text stays in the output all the same
    (the server's parsers read them: gpt-oss's harmony markers, server/harmony.py)."""
    grammar: GrammarSpec | None = None
    prompt_logprobs_from: int | None = None
    """Report the logprob of every prompt token at this position and after (>= 1).
    The radix cache serves at most the tokens before it (their logits are needed)."""
    prompt_top_logprobs: int = 0
    """With prompt_logprobs_from: also the top this-many tokens (id, logprob) at each of those
    positions (OpenAI's echo with logprobs > 0)."""
    cache_salt: str | None = None
    """Prefix-cache namespace: requests share cached KV pages only with requests of the same
    salt (None: the unsalted namespace), so neither `cached_tokens` nor timing tells one
    tenant whether another's prompt is cached."""
    timeout: float | None = None
    """Seconds from the engine's receipt of the request to its deadline (None: none). At the
    deadline the request ends wherever it is (tokenizing, queued, running), its pages are
    freed, and its final output has finish_reason "timeout" (with what it generated so far)."""
    keep_prefix: str | None = None
    """A key (a WebSocket session's id): when the request leaves, the path of its tokens stays
    pinned in the prefix cache (on the device or the host tier, which never drops it) under
    that key, replacing the key's previous path, until abort(key) or keep_prefix_s later
    (engine/scheduler/keeps.py)."""
    keep_prefix_s: float = 600.0
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the last this-many tokens of the prompt (-1: the context's length), cut
    after the chat template and before the context checks; None: a prompt too long is refused."""
    embed: bool = False
    """The answer is the prompt's embedding (RequestOutput.embedding: the final hidden state at its
    last token), not text: max_tokens 1, the token sampled dropped (/v1/embeddings, LLM.embed)."""
    lora: str | None = None
    """The LoRA adapter to run with (EngineConfig.lora_modules; None: the base model); the
    tokenizer folds it into cache_salt (an adapter's KV is its own)."""
    prediction: str | list[int] | None = None
    """Text (or token ids) the output is expected to repeat (OpenAI's Predicted Outputs): ngram
    speculation's proposals follow it (spec/ngram.py from_prediction); verification keeps what
    the model itself writes, so the output is the same without it (or without ngram)."""

    def validate(self) -> None:
        if self.max_tokens < 1 and not self.fill_context:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (math.inf if self.fill_context else self.max_tokens):
            raise RequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise RequestError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}")
        if any(not w.strip() for w in self.bad_words):
            raise RequestError("bad_words must not hold an empty (or blank) word")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if not 0 <= self.prompt_top_logprobs <= 20:
            raise RequestError(f"prompt_top_logprobs must be in [0, 20], got {self.prompt_top_logprobs}")
        if self.prompt_top_logprobs and self.prompt_logprobs_from is None:
            raise RequestError("prompt_top_logprobs needs prompt_logprobs_from")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT:
            raise RequestError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters")
        if self.timeout is not None and not 0 < self.timeout < math.inf:  # (NaN fails too)
            raise RequestError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.keep_prefix is not None and not 0 < len(self.keep_prefix) <= MAX_CACHE_SALT:
            raise RequestError(f"keep_prefix must be a string of 1 to {MAX_CACHE_SALT} characters")
        if not 0 < self.keep_prefix_s < math.inf:
            raise RequestError(f"keep_prefix_s must be a positive number of seconds, got {self.keep_prefix_s}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                             or self.truncate_prompt_tokens >= 1):
            raise RequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        if self.embed and (self.max_tokens != 1 or self.fill_context or self.grammar is not None or self.n != 1):
            raise RequestError("an embedding request runs its prompt alone: max_tokens 1, n 1, no grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_history(self) -> bool:
        """Its draws read the output so far: penalties, or a seed (the position of its seeded
        uniform). Batches send the others an empty history."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty) \
            or self.seed is not None


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
ToScheduler = TokenizedRequest | StepOutput | DraftsDrawn | Abort | Finish | Shutdown
ToExecutor = Batch | MaskFill | Shutdown
ToDetokenizer = Register | TokenBatch | Shutdown
