"""The engine interface the server and the frontend language depend on.

Two engines implement it: AsyncEngine (engine/engine.py: the actors on the caller's event
loop) and EngineProcess (engine/remote.py: the same actors in a spawned process, reached
through a socket). Nothing outside streamer/engine needs to know which one it holds.

Contract:
  - start() before anything else but new_request_id(); it is idempotent, and submit() calls
    it when needed. stop() aborts what still runs: every open request gets its final output
    (finish_reason "abort") before stop() returns.
  - submit(request) -> async iterator of RequestOutput increments; exactly one has
    finished=True, and it is the last. Closing the iterator early (a client went away)
    aborts the request. A request the engine refuses (a bad parameter, a prompt too long)
    yields one final output with finish_reason "error"; an engine that dies ends every open
    request with error_code ENGINE_DOWN (ENGINE_STALLED: it stopped answering). Past its
    deadline (SamplingParams.timeout) a request ends with finish_reason "timeout", also when
    the engine does not answer (outputs.deadline_guard).
  - abort(request_id) ends a request wherever it is (a no-op for one that has ended).
  - dead / stalled: why the engine cannot serve (crashed; alive but making no progress),
    or None; new requests are refused while either is set (health.py says when).
  - info: the served model as the server sees it (from start() on for EngineProcess); its
    loras change with load_lora / unload_lora (engine/adapters.py: RequestError where the engine
    does not allow it or a name is taken, ModelLoadError for a folder it cannot take, LoraNotFound).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamer.engine.pooling import Pooling
from streamer.engine_stats import EngineStats
from streamer.messages import GenerateRequest, RequestOutput


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server needs to know of the model; it never tokenizes for the engine."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    hf_tokenizer: Any
    """The transformers tokenizer (None for a weight-only model): token strings of logprobs,
    /tokenize and /apply_chat_template, and the frontend language's text."""
    generation_defaults: Mapping[str, float] = field(default_factory=dict)
    """The model folder's sampling defaults (engine/generation_config.py): what a request
    that omits temperature, top_p, top_k, repetition_penalty or min_p gets, unless the
    server is told otherwise (--generation-config none)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The engine's default template variables (the server decides from them, e.g. whether
    a reasoning model thinks before its constrained answer)."""
    pooling: Pooling = field(default_factory=Pooling)
    """How its embeddings are made (engine/pooling.py: normalized or not, or why none)."""
    loras: tuple[str, ...] = ()
    """The LoRA adapters served beside it (EngineConfig.lora_modules): names a request's model may give."""


class Engine(Protocol):
    @property
    def info(self) -> ModelInfo: ...

    @property
    def dead(self) -> str | None: ...

    @property
    def stalled(self) -> str | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def new_request_id(self) -> str: ...

    def submit(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None: ...

    async def unload_lora(self, name: str) -> None: ...
