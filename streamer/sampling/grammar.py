"""Structured output with xgrammar: compile (cached, on trial under limits), match, mask.

  GrammarCompiler (grammar_compiler.py)       one per engine: compiles and caches GrammarSpecs
  GrammarState                                one per request, used by the scheduler only
    .accept(token) .is_terminated() .fill(bitmask, row) .rollback(n) .jump_forward(limit)
  fill_bitmask(states, vocab_size)            int32 [len(states), ceil(V/32)]; None rows all ones

Spec kinds (messages.GrammarSpec):
  json_object   any JSON object
  json_schema   value: the schema as JSON text
  regex         value: a regular expression the whole output must match
  ebnf          value: an xgrammar EBNF grammar with a `root` rule
  choice        value: a JSON list of strings; the output is exactly one of them
  structural_tag value: an xgrammar structural tag as JSON text, {"type": "structural_tag",
                "format": {...}} (xgrammar's structural_tag.py lists the formats: sequence, tag,
                triggered_tags, tags_with_separator, any_text, json_schema, regex, grammar, ...);
                server/tool_grammar.py builds the tool-call and reasoning ones

JSON is generated compact and fixed-format (`any_whitespace = False`: ", " and ": "
separators, no free whitespace), inside structural tags too (grammar_build.py says how).
A small model cannot then wander into whitespace until max_tokens, and the fixed text
between values (keys, separators) is forced, which is what jump-forward skips over.

Jump-forward is bounded: xgrammar's own find_jump_forward_string runs until the forced
text ends, which for `root ::= "a" root` is never (it froze the server and grew ~450 MB/s).
Here the forced text is found a byte at a time from the token masks, JUMP_MAX_BYTES at most.
"""

from __future__ import annotations

import bisect
import codecs
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from streamer.messages import GrammarSpec

BATCH_FILL_MIN = 8
"""From this many constrained rows on, masks are filled by xgrammar's thread pool..."""
BATCH_FILL_THREADS = min(8, (os.cpu_count() or 1) // 2)
"""...of this many threads; below 2 the pool only adds overhead and rows are filled in turn
(measured on 2 cores: 4.6 us/row in turn vs 6.3 us/row through a 1-thread pool)."""
JUMP_MAX_BYTES = 128
"""The most forced text one request's jump-forward takes (the rest at the next step). A byte
costs a mask fill and a look at it: ~4-20 us (SmolLM2's vocabulary, by grammar)..."""
JUMP_STEP_BYTES = 1024
"""...and all the jumps after one step together take at most this many bytes (~20 ms at
worst), however many grammar requests run."""


class _Vocab:
    """The decoded vocabulary, arranged to tell from a token mask which bytes may come next."""

    def __init__(self, info: xgr.TokenizerInfo, vocab_size: int) -> None:
        self.decoded: list[bytes] = list(info.decoded_vocab)
        self.sorted = sorted(set(self.decoded))
        self.excluded = frozenset(info.stop_token_ids) | frozenset(info.special_token_ids)
        self.words = (vocab_size + 31) // 32
        self.stops = sorted(t for t in info.stop_token_ids if 0 <= t < vocab_size)
        # A token is allowed only where its first byte is, and a byte b is allowed exactly when
        # the one-byte token b is (masks are prefix-closed); bytes with no one-byte token are
        # seen through the tokens that start with them ("orphans").
        single: dict[int, int] = {}
        for t, text in enumerate(self.decoded[:vocab_size]):
            if len(text) == 1 and t not in self.excluded:
                single.setdefault(text[0], t)
        self.single_bytes = np.array(sorted(single), dtype=np.int64)
        self.single_word, self.single_bit = _bit_of([single[b] for b in self.single_bytes])
        orphans = [t for t, text in enumerate(self.decoded[:vocab_size])
                   if text and text[0] not in single and t not in self.excluded]
        self.orphan_word, self.orphan_bit = _bit_of(orphans)
        self.orphan_bytes = np.array([self.decoded[t][0] for t in orphans], dtype=np.int64)

    def extensible(self, token: int) -> bool:
        """True if some other vocabulary token is a strict extension of this token's text."""
        if not 0 <= token < len(self.decoded):
            return False
        text = self.decoded[token]
        i = bisect.bisect_right(self.sorted, text)
        return i < len(self.sorted) and self.sorted[i].startswith(text)

    def forced_byte(self, mask: np.ndarray) -> int | None:
        """The one byte that every allowed token starts with, where no stop token is allowed
        (the output may end there); None when there is a choice."""

        for t in self.stops:
            if mask[t >> 5] >> (t & 31) & 1:
                return None
        found = self.single_bytes[(mask[self.single_word] & self.single_bit) != 0]
        if len(self.orphan_bytes):
            found = np.union1d(found, self.orphan_bytes[(mask[self.orphan_word] & self.orphan_bit) != 0])
        return int(found[0]) if len(found) == 1 else None


def _bit_of(ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Where token ids sit in an int32 bitmask row: word indices, and each bit as an int32."""
    a = np.array(ids, dtype=np.int64)
    return a >> 5, (np.ones_like(a) << (a & 31)).astype(np.uint32).view(np.int32)


class GrammarState:
    """One request's matcher. Advances with every output token (sampled or jumped over)."""

    __slots__ = ("matcher", "spec", "num_accepted", "rejected", "jump_bytes", "_encode", "_vocab")

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
        self.jump_bytes = 0
        """Forced bytes the last jump_forward_string found (its cost: a mask fill each)."""
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

    def jump_forward_string(self, max_bytes: int = JUMP_MAX_BYTES) -> str:
        """The text the grammar forces from here, at most max_bytes of it ("" when there is a
        choice). Whole UTF-8 characters only: a character cut by the limit (or begun by the
        last token) is left to the next jump."""
        v = self._vocab
        self.jump_bytes = 0
        if v is None or self.matcher.is_terminated():
            return ""
        mask = torch.empty((1, v.words), dtype=torch.int32)
        words = mask.numpy()[0]
        forced = bytearray()
        walker: xgr.GrammarMatcher | None = None  # a fork, advanced byte by byte
        while len(forced) < max_bytes:
            (walker or self.matcher).fill_next_token_bitmask(mask, 0)
            b = v.forced_byte(words)
            if b is None:
                break
            if walker is None:
                walker = self.matcher.fork()
            if not walker.accept_string(bytes([b])):
                break
            forced.append(b)
        self.jump_bytes = len(forced)
        if forced and forced[0] & 0xC0 == 0x80:
            return ""  # it starts inside a character (the last token split one), as xgrammar's does
        try:  # (final=False: an incomplete last character is held back, not an error)
            return codecs.getincrementaldecoder("utf-8")().decode(bytes(forced), final=False)
        except UnicodeDecodeError:
            return ""

    def jump_forward(self, limit: int, max_bytes: int = JUMP_MAX_BYTES) -> list[int]:
        """Tokens of the forced continuation, already accepted; at most `limit` of them.

        The forced text is tokenized with the model's tokenizer. Its last token is left to
        the model when a longer vocabulary token extends it (the model may want to merge it
        with what follows, e.g. `"` + a value); tokens are accepted one by one and the jump
        stops at the first one the matcher refuses, so the output stays in the grammar
        whatever the tokenizer does at the edges.
        """
        self.jump_bytes = 0
        if limit <= 0 or max_bytes <= 0 or self._encode is None or self._vocab is None:
            return []
        text = self.jump_forward_string(max_bytes)
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
