"""What a request asks of its sampling: SamplingParams (and its output constraint, GrammarSpec),
validated where it enters the engine (the tokenizer actor). It travels inside the actors' messages
(streamer/messages.py re-exports both: callers import them from there or from here)."""

from __future__ import annotations

import math

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
        if any(not s for s in self.stop):
            raise RequestError("stop must not hold an empty string (it would end the request at once)")
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
