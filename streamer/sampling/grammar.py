"""Structured output with xgrammar: compile (cached, time-limited), match, mask.

  GrammarCompiler(hf_tokenizer, vocab_size)   one per engine (TokenizerInfo over the model vocab)
    .state_for(GrammarSpec) -> GrammarState   a fresh matcher; RequestError for a bad spec
  GrammarState                                one per request, used by the scheduler only
    .accept(token) .is_terminated() .fill(bitmask, row) .rollback(n) .jump_forward(limit)
  fill_bitmask(states, vocab_size)            int32 [len(states), ceil(V/32)]; None rows all ones

Spec kinds (messages.GrammarSpec):
  json_object   any JSON object
  json_schema   value: the schema as JSON text
  regex         value: a regular expression the whole output must match
  ebnf          value: an xgrammar EBNF grammar with a `root` rule
  choice        value: a JSON list of strings; the output is exactly one of them

JSON is generated compact and fixed-format (`any_whitespace = False`: ", " and ": "
separators, no free whitespace). A small model cannot then wander into
whitespace until max_tokens, and the fixed text between values (keys,
separators) is forced, which is what jump-forward skips over.

Compiled grammars are cached by (kind, value), errors included, so a repeated
bad schema fails at once. Compilation runs in a daemon thread and is awaited
for at most `timeout_s`; on a timeout the request fails but the compilation
goes on and lands in the cache for the next request with the same spec.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import xgrammar as xgr

from streamer.errors import RequestError
from streamer.messages import GrammarSpec

log = logging.getLogger("streamer.grammar")

KINDS = ("json_object", "json_schema", "regex", "ebnf", "choice")

BATCH_FILL_MIN = 8
"""From this many constrained rows on, masks are filled by xgrammar's thread pool..."""
BATCH_FILL_THREADS = min(8, (os.cpu_count() or 1) // 2)
"""...of this many threads; below 2 the pool only adds overhead and rows are filled in turn
(measured on 2 cores: 4.6 us/row in turn vs 6.3 us/row through a 1-thread pool)."""


def _clean(err: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp, a source path and a check text; drop them."""
    msg = str(err).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(err).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly the given literals (JSON escapes are EBNF escapes)."""
    alts = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(json.dumps(c) for c in alts)


class _Vocab:
    """Decoded vocabulary, sorted, to ask whether a longer token starts with a token's text."""

    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.decoded: list[bytes] = list(info.decoded_vocab)
        self.sorted = sorted(set(self.decoded))
        self.excluded = frozenset(info.stop_token_ids) | frozenset(info.special_token_ids)

    def extensible(self, token: int) -> bool:
        """True if some other vocabulary token is a strict extension of this token's text."""
        if not 0 <= token < len(self.decoded):
            return False
        text = self.decoded[token]
        i = bisect.bisect_right(self.sorted, text)
        return i < len(self.sorted) and self.sorted[i].startswith(text)


class GrammarState:
    """One request's matcher. Advances with every output token (sampled or jumped over)."""

    __slots__ = ("matcher", "spec", "num_accepted", "rejected", "_encode", "_vocab")

    def __init__(
        self,
        matcher: xgr.GrammarMatcher,
        spec: GrammarSpec,
        encode: Callable[[str], list[int]] | None = None,
        vocab: _Vocab | None = None,
    ) -> None:
        self.matcher = matcher
        self.spec = spec
        self.num_accepted = 0
        self.rejected = False
        """Set when a token was refused: the request cannot continue under its grammar."""
        self._encode = encode
        self._vocab = vocab

    def accept(self, token: int) -> bool:
        ok = bool(self.matcher.accept_token(token))
        if ok:
            self.num_accepted += 1
        else:
            self.rejected = True
        return ok

    def is_terminated(self) -> bool:
        """The grammar ended and its stop token was accepted: the request is complete."""
        return bool(self.matcher.is_terminated())

    def is_completed(self) -> bool:
        """The output so far is a full sentence of the grammar (only a stop token may follow,
        or more text where the grammar allows it)."""
        return bool(self.matcher.is_completed())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, n: int) -> None:
        if n > 0:
            self.matcher.rollback(n)
            self.num_accepted -= n
            self.rejected = False

    def jump_forward_string(self) -> str:
        """The longest text the grammar forces from here ("" when there is a choice)."""
        return self.matcher.find_jump_forward_string()

    def jump_forward(self, limit: int) -> list[int]:
        """Tokens of the forced continuation, already accepted; at most `limit` of them.

        The forced text is tokenized with the model's tokenizer. Its last token is left to
        the model when a longer vocabulary token extends it (the model may want to merge it
        with what follows, e.g. `"` + a value); tokens are accepted one by one and the jump
        stops at the first one the matcher refuses, so the output stays in the grammar
        whatever the tokenizer does at the edges.
        """
        if limit <= 0 or self._encode is None or self._vocab is None:
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        try:
            toks = self._encode(text)
        except Exception:  # noqa: BLE001 - a tokenizer oddity only costs the jump
            return []
        if toks and self._vocab.extensible(toks[-1]):
            toks = toks[:-1]
        out: list[int] = []
        for t in toks[:limit]:
            if t in self._vocab.excluded or not self.accept(t):
                self.rejected = False  # a refused jump token is not an error, just the jump's end
                break
            out.append(t)
        return out


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer, with a cache and a time limit."""

    timeout_s: float = 10.0
    any_whitespace: bool = False
    cache_size: int = 512

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: list[int] | None = None,
        max_threads: int = 8,
    ) -> None:
        """vocab_size: the model's (the LM head's width), which may exceed the tokenizer's.
        stop_token_ids: the tokens that end a finished grammar (the engine's EOS ids);
        None lets xgrammar read them from the tokenizer."""
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._hf = hf_tokenizer
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._vocab: _Vocab | None = None

    # ---- compile ----------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def _build(self, kind: str, value: str) -> xgr.CompiledGrammar:
        c = self.compiler
        ws = self.any_whitespace
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=ws, strict_mode=False)
        if kind == "json_schema":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                raise RequestError(f"invalid json_schema: not JSON ({e})") from None
            if not isinstance(schema, dict | bool):
                raise RequestError("invalid json_schema: a schema must be a JSON object")
            return c.compile_json_schema(value, any_whitespace=ws)
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "ebnf":
            return c.compile_grammar(value)
        if kind == "choice":
            try:
                choices = json.loads(value)
            except json.JSONDecodeError as e:
                raise RequestError(f"invalid choice: not a JSON list of strings ({e})") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(s, str) for s in choices):
                raise RequestError("invalid choice: give a non-empty JSON list of strings")
            if not all(choices):
                raise RequestError("invalid choice: the choices must not be empty strings")
            return c.compile_grammar(choice_grammar(choices))
        raise RequestError(f"unknown grammar kind {kind!r}; use one of {', '.join(KINDS)}")

    def _start(self, kind: str, value: str) -> Future:
        fut: Future = Future()

        def work() -> None:
            try:
                fut.set_result(self._build(kind, value))
            except RequestError as e:
                fut.set_exception(e)
            except Exception as e:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
                fut.set_exception(RequestError(f"invalid {kind}: {_clean(e)}"))

        threading.Thread(target=work, name="streamer-grammar", daemon=True).start()
        return fut

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of spec (cached); RequestError if invalid or too slow."""
        if spec.kind not in KINDS:
            raise RequestError(f"unknown grammar kind {spec.kind!r}; use one of {', '.join(KINDS)}")
        key = (spec.kind, spec.value)
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._cache[key] = self._start(*key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RequestError(
                f"compiling the {spec.kind} grammar took longer than {self.timeout_s:g} s; "
                "simplify the schema or pattern"
            ) from None

    def state_for(self, spec: GrammarSpec) -> GrammarState:
        compiled = self.compile(spec)
        if self._vocab is None:
            self._vocab = _Vocab(self.info)
        return GrammarState(xgr.GrammarMatcher(compiled), spec, self._encode, self._vocab)


# ---- bitmasks --------------------------------------------------------------
_batch_matcher: xgr.BatchGrammarMatcher | None = None


def fill_bitmask(states: Sequence[GrammarState | None], vocab_size: int, pin: bool = False) -> torch.Tensor:
    """Bitmask int32 [len(states), ceil(vocab_size/32)]: bit t of row i set = token t allowed.

    Rows whose state is None (unconstrained requests) are all ones. pin: in pinned memory
    (for a CUDA engine: the mask goes up to the device as it is, no staging copy, and the
    copy does not wait for the forward in flight).
    """
    global _batch_matcher
    mask = torch.full(((len(states)), (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)
    rows = [i for i, s in enumerate(states) if s is not None]
    if len(rows) >= BATCH_FILL_MIN and BATCH_FILL_THREADS >= 2:
        if _batch_matcher is None:
            _batch_matcher = xgr.BatchGrammarMatcher(BATCH_FILL_THREADS)
        _batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], mask, rows)  # type: ignore[union-attr]
    else:
        for i in rows:
            states[i].fill(mask, i)  # type: ignore[union-attr]
    return mask
