"""GrammarCompiler: one per engine, the GrammarSpecs of its requests compiled for its tokenizer.

  GrammarCompiler(hf_tokenizer, vocab_size)
    .state_for(GrammarSpec) -> GrammarState   a fresh matcher (grammar.py); RequestError for a bad spec
    .cached(GrammarSpec) -> GrammarState|None the same when the spec is compiled already

Compiled grammars are cached by (kind, value), errors included, so a repeated bad schema fails
at once. A spec not in the cache is first compiled on trial in a process that is killed past a
time and a memory limit (grammar_worker.py), then here. xgrammar's side (its TokenizerInfo over
the vocabulary, its compiler, the trial process) is built by the first spec.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, NamedTuple

import xgrammar as xgr

from streamer.errors import RequestError
from streamer.messages import GrammarSpec
from streamer.sampling.grammar import GrammarState, _Vocab
from streamer.sampling.grammar_build import KINDS, build, clean_error
from streamer.sampling.grammar_worker import CompilerUnavailable, TrialCompiler

log = logging.getLogger("streamer.grammar")

CACHE_BYTES = 1 << 30
"""Compiled grammars kept, by xgrammar's own count of their memory (and at most cache_size)."""


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer: a cache, and each new spec on trial first."""

    any_whitespace: bool = False
    cache_size: int = 512

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: list[int] | None = None,
        max_threads: int = 8,
        timeout_s: float = 10.0,
        memory_bytes: int = 2 << 30,
        workers: int = 2,
    ) -> None:
        """vocab_size: the model's (the LM head's width), which may exceed the tokenizer's.
        stop_token_ids: the tokens that end a finished grammar (the engine's EOS ids);
        None lets xgrammar read them from the tokenizer. timeout_s, memory_bytes: the limits
        of one compilation; workers: compilations on trial at once (the others queue)."""
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        # xgrammar's side is built on first use (_backend): TokenizerInfo over a 49k vocabulary
        # takes ~0.3 s, which an engine that never sees a grammar should not pay at start
        self._stop_token_ids = stop_token_ids or None
        self._max_threads, self._memory_bytes, self._workers = max_threads, memory_bytes, workers
        self._backend_lock = threading.Lock()
        self._built: _Backend | None = None
        self._hf = hf_tokenizer
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_bytes = 0
        self._vocab: _Vocab | None = None

    def _backend(self) -> _Backend:
        with self._backend_lock:
            if self._built is None:
                try:
                    info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                              stop_token_ids=self._stop_token_ids)
                    # (no cache of xgrammar's own: this class keeps the compiled grammars, within CACHE_BYTES)
                    compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
                    trials = TrialCompiler(info, any_whitespace=self.any_whitespace, timeout_s=self.timeout_s,
                                           memory_bytes=self._memory_bytes, workers=self._workers)
                    self._built = _Backend(info, compiler, trials)
                except Exception as e:  # noqa: BLE001 - xgrammar could not read this tokenizer
                    raise RequestError(f"structured output is not available for this model: {clean_error(e)}") from None
            return self._built

    @property
    def info(self) -> xgr.TokenizerInfo:
        return self._backend().info

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        return self._backend().compiler

    @property
    def trials(self) -> TrialCompiler:
        return self._backend().trials

    # ---- compile ----------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def _build(self, kind: str, value: str) -> xgr.CompiledGrammar:
        if kind != "json_object":  # (the one spec of fixed size needs no trial)
            self.trials.trial(kind, value)
        try:
            return build(self.compiler, kind, value, self.any_whitespace)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
            raise RequestError(f"invalid {kind}: {clean_error(e)}") from None

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of spec (cached); RequestError if invalid or over a limit.
        Blocks for as long as the compilation takes: call it off the event loop."""
        if spec.kind not in KINDS:
            raise RequestError(f"unknown grammar kind {spec.kind!r}; use one of {', '.join(KINDS)}")
        key = (spec.kind, spec.value)
        with self._lock:
            fut = self._cache.get(key)
            owner = fut is None
            if fut is None:
                fut = self._cache[key] = Future()
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                compiled = self._build(*key)
            except RequestError as e:
                fut.set_exception(e)
                if isinstance(e, CompilerUnavailable):  # says nothing of the spec: not kept
                    with self._lock:
                        self._cache.pop(key, None)
            else:
                fut.set_result(compiled)
                self._account(compiled.memory_size_bytes)
        return fut.result()

    def _account(self, size: int) -> None:
        """Evict the oldest compiled grammars past cache_size entries or CACHE_BYTES."""
        with self._lock:
            self._cache_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size or self._cache_bytes > CACHE_BYTES):
                _, old = self._cache.popitem(last=False)
                if old.done() and old.exception() is None:
                    self._cache_bytes -= old.result().memory_size_bytes

    def _state(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec) -> GrammarState:
        if self._vocab is None:
            self._vocab = _Vocab(self.info, self.vocab_size)
        return GrammarState(xgr.GrammarMatcher(compiled), spec, self._encode, self._vocab)

    def state_for(self, spec: GrammarSpec) -> GrammarState:
        return self._state(self.compile(spec), spec)

    def cached(self, spec: GrammarSpec) -> GrammarState | None:
        """A state for spec if it is compiled already (raises its cached error), else None."""
        with self._lock:
            fut = self._cache.get((spec.kind, spec.value))
        if fut is None or not fut.done():
            return None
        return self._state(fut.result(), spec)

    def start(self) -> None:
        """Build xgrammar's side and start the trial process now, in the background (else both
        happen with the first new spec)."""

        def run() -> None:
            try:
                self.trials.start()
            except RequestError as e:  # (the first spec will say so too)
                log.warning("%s", e)

        threading.Thread(target=run, name="streamer-grammar-backend", daemon=True).start()

    def close(self) -> None:
        """Stop the trial process (it starts again on the next new spec)."""
        with self._backend_lock:
            built = self._built
        if built is not None:
            built.trials.close()


class _Backend(NamedTuple):
    """xgrammar's side of a GrammarCompiler."""

    info: xgr.TokenizerInfo
    compiler: xgr.GrammarCompiler
    trials: TrialCompiler
