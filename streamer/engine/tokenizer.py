"""Tokenizer actor: text or chat messages -> token ids, validated.

Inbox:  GenerateRequest, None to stop.
Outbox: TokenizedRequest -> scheduler; TokenDelta(error) -> detokenizer for a
        request that cannot be served (too long, bad parameters, bad grammar).
Invariants: tokenization and grammar compilation run in a worker thread, never
on the event loop (a request that is already token ids, short and without a
grammar, is only validated, in place: the thread hop cost more than that); requests
leave in the order they arrived.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from streamer.errors import ModelLoadError, RequestError
from streamer.messages import GenerateRequest, TokenDelta, TokenizedRequest


def load_tokenizer(path: Path) -> Any:
    """The transformers tokenizer of a model folder, or None if the folder has none."""
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: the tokenizer cannot be loaded ({e})") from None


class Tokenizer:
    """The synchronous part: owns the transformers tokenizer (None for weight-only models)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.grammars: Any = None  # sampling.grammar.GrammarCompiler, set when available

    def encode_prompt(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, prompt_token_ids or messages")
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
            return ids
        if self.hf is None:
            raise RequestError("this model has no tokenizer: send prompt_token_ids")
        if req.messages is not None:
            try:
                ids = self.hf.apply_chat_template(
                    req.messages, tokenize=True, add_generation_prompt=req.add_generation_prompt
                )
            except Exception as e:  # noqa: BLE001 - template errors come from user messages
                raise RequestError(f"cannot apply the chat template to these messages: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        assert req.prompt is not None
        return list(self.hf(req.prompt, add_special_tokens=True)["input_ids"])

    def __call__(self, req: GenerateRequest, arrival: float) -> TokenizedRequest:
        req.params.validate()
        ids = self.encode_prompt(req)
        if not ids:
            raise RequestError("the prompt is empty")
        total = len(ids) + req.params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and max_tokens is {req.params.max_tokens} ({total} in all)"
            )
        grammar = None
        if req.params.grammar is not None:
            if self.grammars is None:
                raise RequestError("structured output is not available for this model")
            grammar = self.grammars.state_for(req.params.grammar)
        return TokenizedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            params=req.params,
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
            arrival=arrival,
        )


INLINE_MAX_TOKENS = 4096


def inline(req: GenerateRequest) -> bool:
    """Nothing to tokenize or compile: validating the ids takes microseconds."""
    ids = req.prompt_token_ids
    return ids is not None and len(ids) <= INLINE_MAX_TOKENS and req.params.grammar is None


async def run(tok: Tokenizer, inbox: asyncio.Queue, to_scheduler: asyncio.Queue, to_detok: asyncio.Queue) -> None:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-tok") as thread:
        while True:
            item = await inbox.get()
            if item is None:
                return
            req, arrival = item
            try:
                if inline(req):
                    out = tok(req, arrival)
                else:
                    out = await loop.run_in_executor(thread, tok, req, arrival)
            except RequestError as e:
                to_detok.put_nowait([TokenDelta(req.request_id, [], finish_reason="error", error=str(e))])
                continue
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the actor
                to_detok.put_nowait(
                    [TokenDelta(req.request_id, [], finish_reason="error", error=f"cannot tokenize: {e}")]
                )
                continue
            to_scheduler.put_nowait(out)
