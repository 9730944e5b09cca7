"""Detokenizer actor: token ids -> text deltas, stop strings, per-request queues.

Inbox:  Register (a new request's output queue), TokenBatch (from the scheduler or the
        tokenizer), Shutdown (the engine stops; the scheduler has sent its last "abort"s).
Outbox: RequestOutput -> each request's queue (or shared sink); Finish -> scheduler when a
        stop string matched (so its pages are freed at once).
Invariants: a text delta never ends inside a UTF-8 character (it waits for the
bytes that complete it); text of a matched stop string never reaches the
caller (unless params.include_stop: then it ends the text), also when the string spans
several tokens (text that could still become a stop string is held back); each request gets exactly one final
output (finished=True), after which it is forgotten.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import msgspec

from streamer.messages import (
    Finish,
    Register,
    RequestOutput,
    SamplingParams,
    Shutdown,
    ToDetokenizer,
    TokenDelta,
    ToScheduler,
)


def _no_clean_up(hf_tokenizer: Any) -> bool:
    """True when transformers' decode is the Rust decode alone: no clean-up pass is asked
    for, or transformers skips it because the model is BPE (Llama 3, Qwen: the pass would
    strip real spaces before punctuation) and the override flag of the versions that skip
    it is off. Older versions without that flag clean up BPE too: the slow path stays."""
    if not getattr(hf_tokenizer, "clean_up_tokenization_spaces", True):
        return True
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    override = getattr(hf_tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    return backend is not None and type(backend.model).__name__ == "BPE" and override is False


@functools.lru_cache(maxsize=8)
def _skipped_ids(hf_tokenizer: Any, keep: tuple[str, ...]) -> frozenset[int]:
    """The ids skip_special_tokens drops, but those of the tokens in `keep`: the added
    tokens marked special, and the tokenizer's named special tokens."""
    special = {i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    special.update(getattr(hf_tokenizer, "all_special_ids", ()))
    kept = {i for t, i in hf_tokenizer.get_added_vocab().items() if t in keep}
    return frozenset(special - kept)


class IncrementalText:
    """Decode a growing list of token ids, emitting only complete characters.

    keep: special tokens whose text stays under skip_special_tokens. The other special
    tokens are then dropped from the ids before a decode that skips nothing."""

    def __init__(self, hf_tokenizer: Any, skip_special_tokens: bool, keep: tuple[str, ...] = ()) -> None:
        self.hf = hf_tokenizer
        self.skip = skip_special_tokens
        self.drop: frozenset[int] | None = None
        if skip_special_tokens and keep and hf_tokenizer is not None:
            self.skip, self.drop = False, _skipped_ids(hf_tokenizer, tuple(sorted(keep)))
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        # The Rust tokenizer's own decode gives the same text as transformers' decode when
        # no clean-up pass follows, at a quarter of the cost (two decodes per token per
        # stream run on the event loop: 256 streams at saturation).
        self.backend = getattr(hf_tokenizer, "backend_tokenizer", None) if _no_clean_up(hf_tokenizer) else None

    def _decode(self, ids: list[int]) -> str:
        if self.drop:
            ids = [i for i in ids if i not in self.drop]
        if not ids:
            return ""
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip)
        return self.hf.decode(ids, skip_special_tokens=self.skip)

    def push(self, new: list[int], final: bool = False) -> str:
        self.ids.extend(new)
        if self.hf is None:
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Stream:
    """One request's output state."""

    def __init__(self, hf_tokenizer: Any, params: SamplingParams, queue: asyncio.Queue) -> None:
        self.text = IncrementalText(hf_tokenizer, params.skip_special_tokens, tuple(params.keep_special_tokens))
        self.stops = [s for s in params.stop if s]
        self.include_stop = params.include_stop
        self.queue = queue
        self.full = ""  # the text so far, kept only to find stop strings in it
        self.sent = 0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cached_host_tokens = 0

    def update(self, d: TokenDelta) -> tuple[RequestOutput, bool]:
        """(output to send, whether a stop string ended the request here)."""
        if self.stops and len(d.token_ids) > 1:
            return self._update_each(d)
        return self._update_one(d)

    def _update_each(self, d: TokenDelta) -> tuple[RequestOutput, bool]:
        """A delta of several tokens (speculative decoding's kept run, a grammar's jump) with
        stop strings: token by token, as if decoded one at a time, so that no token after
        the one completing a stop string is output (nor counted)."""
        outs: list[RequestOutput] = []
        stopped = False
        n = len(d.token_ids)
        for i, t in enumerate(d.token_ids):
            last = i == n - 1
            sub = msgspec.structs.replace(
                d, token_ids=[t], logprobs=None if d.logprobs is None else d.logprobs[i : i + 1],
                finish_reason=d.finish_reason if last else None, error=d.error if last else None)
            out, stopped = self._update_one(sub)
            outs.append(out)
            if stopped or out.finished:
                break
        first, end = outs[0], outs[-1]
        logprobs = None if d.logprobs is None else [lp for o in outs for lp in o.logprobs or []]
        return msgspec.structs.replace(
            end, token_ids=[t for o in outs for t in o.token_ids], text="".join(o.text for o in outs),
            logprobs=logprobs, prompt_logprobs=first.prompt_logprobs, queue_time=first.queue_time,
            prompt_token_ids=first.prompt_token_ids, prompt_top_logprobs=first.prompt_top_logprobs,
            prompt_ranks=first.prompt_ranks,
            prediction_token_ids=first.prediction_token_ids,
        ), stopped

    def _update_one(self, d: TokenDelta) -> tuple[RequestOutput, bool]:
        if d.prompt_tokens:
            self.prompt_tokens, self.cached_tokens = d.prompt_tokens, d.cached_tokens
            self.cached_host_tokens = d.cached_host_tokens
        self.completion_tokens += len(d.token_ids)
        final = d.finish_reason is not None
        piece = self.text.push(d.token_ids, final=final)
        if not self.stops:  # nothing to search or hold back: the new text goes out as it is
            return self._output(d, piece, final, d.finish_reason), False
        start = max(0, len(self.full) - max((len(s) for s in self.stops), default=0))
        self.full += piece
        reason, stopped = d.finish_reason, False
        end = len(self.full)
        hits = [(i, -len(s), s) for i, s in ((self.full.find(s, start), s) for s in self.stops) if i >= 0]
        matched = None
        if hits:
            at, longest, matched = min(hits)  # the first match (of two at one place, the longer string)
            end, reason, stopped, final = at - longest if self.include_stop else at, "stop", True, True
        elif not final:
            end -= _held_back(self.full, self.stops)
        out = self._output(d, self.full[self.sent : end], final, reason)
        out.stop = matched
        self.sent = max(self.sent, end)
        return out, stopped

    def _output(self, d: TokenDelta, text: str, final: bool, reason: str | None) -> RequestOutput:
        return RequestOutput(
            d.request_id,
            d.token_ids,
            text,
            finished=final,
            finish_reason=reason if final else None,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            cached_host_tokens=self.cached_host_tokens,
            logprobs=d.logprobs,
            error=d.error,
            prompt_logprobs=d.prompt_logprobs,
            queue_time=d.queue_time,
            error_code=d.error_code,
            prompt_token_ids=d.prompt_token_ids,
            prompt_top_logprobs=d.prompt_top_logprobs,
            prompt_ranks=d.prompt_ranks,
            embedding=d.embedding,
            prediction_token_ids=d.prediction_token_ids,
        )


async def run(
    hf_tokenizer: Any, inbox: asyncio.Queue[ToDetokenizer], to_scheduler: asyncio.Queue[ToScheduler]
) -> None:
    streams: dict[str, Stream] = {}
    while True:
        msg = await inbox.get()
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Register):
            streams[msg.request_id] = Stream(hf_tokenizer, msg.params, msg.queue)
            continue
        for d in msg.deltas:
            s = streams.get(d.request_id)
            if s is None:
                continue  # finished already (e.g. a stop string), later tokens are dropped
            out, stopped = s.update(d)
            s.queue.put_nowait(out)
            if out.finished:
                del streams[d.request_id]
            if stopped and d.finish_reason is None:
                to_scheduler.put_nowait(Finish(d.request_id, "stop"))
