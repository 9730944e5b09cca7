"""Tokenizer actor: text or chat messages -> token ids, validated.

Inbox:  Tokenize (a GenerateRequest and its arrival time), Shutdown.
Outbox: TokenizedRequest -> scheduler; TokenBatch([TokenDelta(error)]) -> detokenizer for a
        request that cannot be served (too long, bad parameters, bad grammar), and
        TokenDelta(abort) at stop for requests still waiting for their grammar.
Invariants: a request's parameters are validated here, once, whoever submitted it (the
server maps its bodies to SamplingParams and leaves validating to this actor). Only here
is the prompt's length known, so here `fill_context` becomes a number: max_tokens is the
room the prompt leaves in the context (and in the KV pool), and a prompt that leaves none
is refused with the context-length error (code CONTEXT_LENGTH_EXCEEDED). Tokenization
and grammar compilation run in worker threads, never on the event loop (a request that
is already token ids, short and without a grammar, is only validated, in place: the
thread hop cost more than that). Requests leave in
the order they arrived, except that one whose grammar is not compiled yet leaves when
it is: a compilation can take up to its time limit, and nobody else waits for it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from streamer.chat_template import render
from streamer.errors import ModelLoadError, RequestError
from streamer.messages import (
    CONTEXT_LENGTH_EXCEEDED,
    GenerateRequest,
    SamplingParams,
    Shutdown,
    TokenBatch,
    TokenDelta,
    Tokenize,
    TokenizedRequest,
)


def load_tokenizer(path: Path, chat_template: str | None = None) -> Any:
    """The transformers tokenizer of a model folder, or None if the folder has none.
    chat_template: a Jinja file that replaces the model's template (--chat-template)."""
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        if chat_template:
            raise ModelLoadError(f"--chat-template {chat_template}: {path} has no tokenizer to apply it with")
        return None
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: the tokenizer cannot be loaded ({e})") from None
    if chat_template:
        try:
            tok.chat_template = Path(chat_template).read_text()
        except OSError as e:
            raise ModelLoadError(f"--chat-template {chat_template}: cannot read it ({e.strerror})") from None
    return tok


class ContextLengthError(RequestError):
    """The prompt and max_tokens do not fit the context (error code CONTEXT_LENGTH_EXCEEDED)."""


class Tokenizer:
    """The synchronous part: owns the transformers tokenizer (None for weight-only models)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int], max_model_len: int, vocab_size: int,
                 pool_tokens: int | None = None) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.room = min(max_model_len, pool_tokens or max_model_len)
        """The tokens a request may hold in all (fill_context): the context, or the whole KV
        pool when that is smaller (the scheduler refuses a request that needs more pages)."""
        self.grammars: Any = None  # sampling.grammar_compiler.GrammarCompiler, set when available
        self.chat_template_kwargs: dict[str, Any] = {}
        """The server's defaults (--default-chat-template-kwargs); a request's own win."""
        self.loras: dict[str, str] = {}
        """The LoRA adapters' names, which SamplingParams.lora may name, and their keys (engine/adapters.py:
        the engine's LoraRegistry.keys, changed by loads and unloads)."""
        self.priorities = False
        """EngineConfig.scheduling_policy is priority: SamplingParams.priority may be other than 0."""

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
            kwargs = {**self.chat_template_kwargs, **(req.chat_template_kwargs or {})}
            return render(self.hf, req.messages, tools=req.tools, kwargs=kwargs,
                          add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message, documents=req.documents,
                          chat_template=req.chat_template)
        if (req.tools is not None or req.chat_template_kwargs is not None or req.documents is not None
                or req.chat_template is not None):
            raise RequestError("tools, chat_template_kwargs, documents and chat_template need messages (a chat "
                               "request)")
        assert req.prompt is not None
        return list(self.hf(req.prompt, add_special_tokens=True)["input_ids"])

    def __call__(self, req: GenerateRequest, arrival: float) -> TokenizedRequest:
        """Validated token ids; the grammar is attached here only when it is compiled
        already (grammar_state does the rest, in a thread of its own)."""
        params = req.params
        params.validate()
        if params.allowed_token_ids is not None:
            self.check_allowed(params)
        if params.priority and not self.priorities:
            raise RequestError(f"priority {params.priority} needs the priority scheduling policy (streamer serve "
                               "--scheduling-policy priority); this engine serves first come, first served")
        if params.lora is not None:
            key = self.loras.get(params.lora)
            if key is None:
                raise RequestError(f"no LoRA adapter is named {params.lora!r}"
                                   + (f" (this engine has {', '.join(self.loras)})" if self.loras else
                                      " (this engine serves none: --lora-modules)"))
            # (from here on the adapter is its key; its KV is the adapter's: a namespace of its own
            # in the prefix cache)
            salt = f"lora:{key}" + ("" if params.cache_salt is None else f":{params.cache_salt}")
            params = msgspec.structs.replace(params, cache_salt=salt, lora=key)
        ids = self.encode_prompt(req)
        if params.truncate_prompt_tokens is not None:  # (the last tokens: where the question is)
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if not ids:
            raise RequestError("the prompt is empty")
        if params.fill_context:
            params = self.fill(params, len(ids))
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and max_tokens is {params.max_tokens} ({total} in all)"
            )
        grammar = None
        if params.grammar is not None:
            if self.grammars is None:
                raise RequestError("structured output is not available for this model")
            grammar = self.grammars.cached(params.grammar)
        return TokenizedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
            arrival=arrival,
            prediction=self.encode_prediction(params.prediction),
            bad_words=self.encode_bad_words(params),
        )

    def check_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids: some, within the vocabulary, without a grammar, and not all of them
        tokens that min_tokens bans (EOS and stop_token_ids): a row could otherwise allow none."""
        ids = params.allowed_token_ids or []
        if not ids or params.grammar is not None:
            raise RequestError("allowed_token_ids must name at least one token, and cannot be combined with a grammar "
                               "(response_format, guided_*: the two could allow no token)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"allowed_token_ids: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if params.min_tokens and set(ids) <= set(self.eos_token_ids) | set(params.stop_token_ids):
            raise RequestError("allowed_token_ids holds only end-of-sequence and stop tokens, which min_tokens bans")

    def encode_bad_words(self, params: SamplingParams) -> list[list[int]] | None:
        """bad_words as token sequences: each word alone and after a space (a word inside a text
        is usually its spaced token), without special tokens; the same sequence once."""
        if not params.bad_words:
            return None
        if self.hf is None:
            raise RequestError("this model has no tokenizer: bad_words needs one")
        seqs: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.hf(text, add_special_tokens=False)["input_ids"])
                if ids and ids not in seqs:
                    seqs.append(ids)
        always = {seq[0] for seq in seqs if len(seq) == 1}
        if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= always:
            raise RequestError("bad_words ban every token of allowed_token_ids")
        return seqs

    def encode_prediction(self, prediction: str | list[int] | None) -> list[int] | None:
        """A prediction's token ids (text tokenized without special tokens, as an output's)."""
        if prediction is None:
            return None
        if isinstance(prediction, str):
            if self.hf is None:
                raise RequestError("this model has no tokenizer: send the prediction as token ids")
            ids = list(self.hf(prediction, add_special_tokens=False)["input_ids"])
        else:
            ids = list(prediction)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prediction: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise RequestError(f"the prediction has {len(ids)} tokens, more than the context ({self.max_model_len})")
        return ids or None

    def fill(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """params with max_tokens the room that a prompt of this length leaves."""
        room = self.room - prompt_tokens
        if room < 1:
            raise ContextLengthError(f"this model's maximum context length is {self.max_model_len} tokens; "
                                     f"the prompt has {prompt_tokens} tokens")
        return msgspec.structs.replace(params, max_tokens=room, fill_context=False)

    def grammar_state(self, out: TokenizedRequest) -> TokenizedRequest:
        """out with its grammar's state (compiling the grammar: blocks up to its limits)."""
        assert self.grammars is not None and out.params.grammar is not None
        out.grammar = self.grammars.state_for(out.params.grammar)
        return out


INLINE_MAX_TOKENS = 4096
GRAMMAR_THREADS = 4
"""Grammars compiled at once (each first on trial in the grammar process, which runs at most
EngineConfig.grammar_compile_workers of them and queues the rest)."""


def inline(req: GenerateRequest) -> bool:
    """Nothing to tokenize or compile: validating the ids takes microseconds."""
    ids = req.prompt_token_ids
    return ids is not None and len(ids) <= INLINE_MAX_TOKENS and req.params.grammar is None


def _error(rid: str, e: Exception) -> TokenDelta:
    msg = str(e) if isinstance(e, RequestError) else f"cannot tokenize: {e}"
    code = CONTEXT_LENGTH_EXCEEDED if isinstance(e, ContextLengthError) else None
    return TokenDelta(rid, [], finish_reason="error", error=msg, error_code=code)


async def run(tok: Tokenizer, inbox: asyncio.Queue[Tokenize | Shutdown], to_scheduler: asyncio.Queue,
              to_detok: asyncio.Queue) -> None:
    loop = asyncio.get_running_loop()
    compiling: dict[asyncio.Future, str] = {}  # grammar compilations in flight -> request id

    async def with_grammar(out: TokenizedRequest) -> None:
        try:
            out = await loop.run_in_executor(grammar_threads, tok.grammar_state, out)
        except Exception as e:  # noqa: BLE001 - a bad grammar must not stop the actor
            to_detok.put_nowait(TokenBatch([_error(out.request_id, e)]))
            return
        to_scheduler.put_nowait(out)

    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-tok")
    grammar_threads = ThreadPoolExecutor(max_workers=GRAMMAR_THREADS, thread_name_prefix="streamer-grammar")
    try:
        while True:
            msg = await inbox.get()
            if isinstance(msg, Shutdown):
                # stopping: requests still waiting for a grammar end with "abort" (their
                # compilations end with the engine's trial process; nobody reads them)
                for task, rid in compiling.items():
                    task.cancel()
                    to_detok.put_nowait(TokenBatch([TokenDelta(rid, [], finish_reason="abort")]))
                return
            req, arrival = msg.request, msg.arrival
            try:
                if inline(req):
                    out = tok(req, arrival)
                else:
                    out = await loop.run_in_executor(thread, tok, req, arrival)
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the actor
                to_detok.put_nowait(TokenBatch([_error(req.request_id, e)]))
                continue
            if out.params.grammar is not None and out.grammar is None:
                task = asyncio.ensure_future(with_grammar(out))
                compiling[task] = out.request_id
                task.add_done_callback(lambda t: compiling.pop(t, None))
                continue
            to_scheduler.put_nowait(out)
    finally:  # (without waiting: the event loop must not block on a thread's work)
        thread.shutdown(wait=False, cancel_futures=True)
        grammar_threads.shutdown(wait=False, cancel_futures=True)
