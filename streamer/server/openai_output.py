"""Engine outputs -> OpenAI's shapes: whole responses (collect) and SSE chunks (events).

Each choice's outputs accumulate in a Choice. Logprobs are formatted as OpenAI reports them:
a token's string is the token decoded alone, and (chat) its `bytes` are the token's own
bytes from the vocabulary (engine/token_bytes.py), which differ from its string's UTF-8
where the token holds part of a character. With echo, a completion choice starts with its
prompt: the prompt's text, and with logprobs its tokens, whose first has no logprob (nothing
predicts it) and the rest the engine's prompt logprobs (SamplingParams.prompt_logprobs_from 1).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from streamer.messages import RequestOutput, SampledToken
from streamer.server import protocol as p
from streamer.server import responses as r
from streamer.server.chat_output import ChatDelta, ChatOutput, ChatSetup, finish_reason
from streamer.server.state import Merged, ServerState, failure
from streamer.sse import DONE_EVENT, data_event


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    offset: int = 0
    """text_offset of the next token (completions' logprobs)."""
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int] | None = None
    """With echo and logprobs, or prompt_logprobs: the prompt's tokens, their logprobs and ranks and
    (if asked) the top tokens at each position after the first (from the first output)."""
    pieces: list[int] = field(default_factory=list)
    """Tokens of each output, beside its text (text[k]: pieces[k] tokens)."""
    token_ids: list[int] = field(default_factory=list)
    """The choice's tokens so far (with a prediction: what usage compares it with)."""
    prediction: list[int] | None = None
    """The request's prediction as the engine tokenized it (RequestOutput.prediction_token_ids)."""
    kept: tuple[int, int] = (-1, 0)
    """(tokens so far, prediction tokens they kept) when last aligned: `prediction_usage`."""
    reasoning_tokens: int = 0
    """Chat: tokens of outputs fed while the reasoning had not ended (ChatChunks.content, chat_choice)."""

    def take_prompt(self, out: RequestOutput) -> None:
        if out.prediction_token_ids is not None:
            self.prediction = out.prediction_token_ids
        if out.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs or []
            self.prompt_top_logprobs, self.prompt_ranks = out.prompt_top_logprobs, out.prompt_ranks

    def prediction_usage(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens so far ((0, 0) without a prediction); aligned
        once per output length, however often the usage is asked for."""
        if self.prediction is None:
            return 0, 0
        if self.kept[0] != len(self.token_ids):
            self.kept = (len(self.token_ids), predicted(self.prediction, self.token_ids))
        return self.kept[1], len(self.prediction) - self.kept[1]

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.pieces.append(len(out.token_ids))
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs or [])
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.cached_host_tokens = out.cached_host_tokens
        self.completion_tokens = out.completion_tokens
        self.take_prompt(out)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error, self.error_code = out.error, out.error_code


def usage(choices: dict[int, Choice], n: int, chat: bool = False) -> r.Usage:
    """Prompt tokens count once per prompt (choice index // n), completions for every choice
    (chat: and of them, the reasoning's, and with a prediction, its tokens each choice has and
    has not: `predicted`)."""
    firsts = [c for i, c in choices.items() if i % n == 0]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices.values())
    details = None
    if chat:
        pairs = [c.prediction_usage() for c in choices.values()]
        details = r.CompletionTokensDetails(sum(c.reasoning_tokens for c in choices.values()),
                                            sum(a for a, _ in pairs), sum(b for _, b in pairs))
    return r.Usage(prompt, completion, prompt + completion,
                   r.PromptTokensDetails(sum(c.cached_tokens for c in firsts),
                                         sum(c.cached_host_tokens for c in firsts)), details)


def predicted(prediction: list[int], tokens: list[int]) -> int:
    """How many of the prediction's tokens appear in the completion's, in order (OpenAI's
    accepted_prediction_tokens; the rest are its rejected ones): the matched blocks of the two
    sequences' alignment (difflib, without its junk heuristic), so text the answer kept counts
    wherever it moved to, and text it rewrote does not."""
    import difflib

    blocks = difflib.SequenceMatcher(None, prediction, tokens, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks)


def joined(a: r.CompletionLogprobs | None, b: r.CompletionLogprobs | None) -> r.CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    return r.CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                                a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)


class Formatter:
    """Token strings and bytes for logprobs (decoded one token at a time, as OpenAI reports them)."""

    def __init__(self, st: ServerState, ids_as_tokens: bool = False) -> None:
        self.st = st
        self.tok = st.info.hf_tokenizer
        self.ids_as_tokens = ids_as_tokens
        """vLLM's return_tokens_as_token_ids: every token's string is "token_id:{id}"."""

    def token(self, tid: int) -> str:
        if self.ids_as_tokens:
            return f"token_id:{tid}"
        return self.tok.decode([tid]) if self.tok is not None else str(tid)

    def token_bytes(self, tid: int) -> list[int] | None:
        return list(self.st.token_bytes(tid)) if self.tok is not None else None

    def offsets(self, tokens: list[str], ids: list[int], c: Choice) -> list[int]:
        """text_offset of each token: where it starts in the choice's text (its string's length
        when tokens are their strings; their text's under ids_as_tokens)."""
        out = []
        for s in tokens if not self.ids_as_tokens else (self.tok.decode([t]) if self.tok else "" for t in ids):
            out.append(c.offset)
            c.offset += len(s)
        return out

    def completion_logprobs(self, lps: list[SampledToken], c: Choice) -> r.CompletionLogprobs | None:
        if not lps:
            return None
        tokens = [self.token(t.token_id) for t in lps]
        tops: list[dict[str, float] | None] = [
            _with_chosen(token, t.logprob, {self.token(i): lp for i, lp in t.top_logprobs or []})
            for token, t in zip(tokens, lps)]
        offsets = self.offsets(tokens, [t.token_id for t in lps], c)
        return r.CompletionLogprobs(tokens, [t.logprob for t in lps], tops, offsets)

    def prompt_logprobs(self, c: Choice, top_k: int) -> r.CompletionLogprobs | None:
        """The echoed prompt's tokens: the first without a logprob or top logprobs (nothing
        predicts it), the others with the engine's (top logprobs: the first top_k, and the
        prompt token's own)."""
        ids = c.prompt_token_ids
        if ids is None:
            return None
        values: list[float | None] = [None, *(c.prompt_logprobs or [])][: len(ids)]
        values += [None] * (len(ids) - len(values))
        tokens = [self.token(t) for t in ids]
        scored = c.prompt_top_logprobs or []
        tops: list[dict[str, float] | None] = [None] * len(ids)
        for k in range(1, len(ids)):
            top = scored[k - 1][:top_k] if k - 1 < len(scored) else []
            if values[k] is not None or top:
                tops[k] = _with_chosen(tokens[k], values[k], {self.token(i): lp for i, lp in top})
        return r.CompletionLogprobs(tokens, values, tops, self.offsets(tokens, ids, c))

    def vllm_prompt_logprobs(self, c: Choice, top_k: int) -> r.PromptLogprobs:
        """vLLM's prompt_logprobs of a choice's prompt: None for its first token, then for each
        token a dict of it (its logprob and rank) and the top_k at its position (ranks 1..top_k),
        by token id, the token itself first."""
        ids = c.prompt_token_ids or []
        values, ranks, tops = c.prompt_logprobs or [], c.prompt_ranks or [], c.prompt_top_logprobs or []
        out: r.PromptLogprobs = [None]
        for k, tid in enumerate(ids[1:]):
            if k >= len(values):  # (a prompt the engine did not score to its end: none here)
                out.append(None)
                continue
            entry = {str(tid): r.PromptLogprob(values[k], ranks[k] if k < len(ranks) else 0, self.token(tid))}
            for rank, (i, lp) in enumerate(tops[k][:top_k] if k < len(tops) else [], start=1):
                entry.setdefault(str(i), r.PromptLogprob(lp, rank, self.token(i)))
            out.append(entry)
        return out[: len(ids)]

    def chat_logprobs(self, lps: list[SampledToken]) -> r.ChoiceLogprobs | None:
        if not lps:
            return None
        content = []
        for t in lps:
            tops = [r.TopLogprob(self.token(i), lp, self.token_bytes(i)) for i, lp in t.top_logprobs or []]
            content.append(r.TokenLogprob(self.token(t.token_id), t.logprob if t.logprob is not None else 0.0,
                                          self.token_bytes(t.token_id), tops))
        return r.ChoiceLogprobs(content)


def _with_chosen(token: str, logprob: float | None, top: dict[str, float]) -> dict[str, float]:
    """A completion's top logprobs at one position: the top k, and the chosen (sampled or
    prompt) token's own, as the legacy API promises ("up to logprobs + 1 elements")."""
    if logprob is not None:
        top.setdefault(token, logprob)
    return top


async def collect(gen: Merged, buffered: list[tuple[int, RequestOutput]], count: int) -> dict[int, Choice]:
    choices = {i: Choice() for i in range(count)}
    try:
        for i, out in buffered:
            choices[i].add(out)
        async for i, out in gen:
            choices[i].add(out)
    finally:
        await gen.aclose()
    for c in choices.values():
        if c.finish_reason in ("error", "timeout"):
            raise failure(c)
    return choices


# ---- SSE -----------------------------------------------------------------------------


class CompletionChunks:
    running: Callable[[], r.Usage] | None = None
    """With stream_options.continuous_usage_stats: the usage so far, which every chunk carries (events sets it)."""

    def __init__(self, fmt: Formatter, rid: str, created: int, model: str, echo: list[str] | None = None,
                 echo_top: int | None = None) -> None:
        self.fmt, self.head = fmt, (rid, "text_completion", created, model)
        self.echo, self.echo_top = echo, echo_top
        """With echo: each choice's prompt text, sent as its first chunk (with logprobs, echo_top not None:
        its tokens' logprobs and the top echo_top at each)."""

    def encode(self, *choices: r.CompletionChoice, use: r.Usage | None = None) -> bytes:
        use = use if use is not None or self.running is None else self.running()
        return data_event(r.CompletionResponse(*self.head, choices=list(choices), usage=use))

    def opening(self, choices: dict[int, Choice]) -> list[bytes]:
        """With echo, each choice's prompt (its first output is in choices already: the
        prompt's logprobs come with it)."""
        if self.echo is None:
            return []
        top = self.echo_top
        return [self.encode(r.CompletionChoice(i, self.echo[i], None if top is None else self.fmt.prompt_logprobs(c, top)))
                for i, c in sorted(choices.items())]

    def content(self, i: int, out: RequestOutput, c: Choice) -> bytes:
        return self.encode(r.CompletionChoice(i, out.text, self.fmt.completion_logprobs(out.logprobs or [], c)))

    def finish(self, i: int, reason: str | None) -> bytes:
        return self.encode(r.CompletionChoice(i, "", None, reason))


class ChatChunks:
    """With tools or reasoning, each choice's text goes through its ChatOutput: markup held
    back until decided, reasoning and calls in their own delta fields."""

    running: Callable[[], r.Usage] | None = None
    """As CompletionChunks.running."""

    def __init__(self, fmt: Formatter, rid: str, created: int, model: str, setup: ChatSetup) -> None:
        self.fmt, self.head = fmt, (rid, "chat.completion.chunk", created, model)
        self.plain = setup.tools is None and setup.reasoning is None
        self.setup = setup
        self.outputs: dict[int, ChatOutput] = {}

    def output(self, i: int) -> ChatOutput:
        if i not in self.outputs:
            self.outputs[i] = self.setup.output()
        return self.outputs[i]

    @staticmethod
    def delta(d: ChatDelta) -> r.Delta:
        calls = [r.DeltaToolCall(k.index, r.DeltaFunction(k.name, k.arguments if k.name is None else k.arguments or ""),
                                 k.id, "function" if k.id is not None else None) for k in d.calls]
        return r.Delta(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)

    def encode(self, *choices: r.ChatChunkChoice, use: r.Usage | None = None) -> bytes:
        use = use if use is not None or self.running is None else self.running()
        return data_event(r.ChatCompletionChunk(*self.head, choices=list(choices), usage=use))

    def opening(self, choices: dict[int, Choice]) -> list[bytes]:
        return [self.encode(r.ChatChunkChoice(i, r.Delta(role="assistant", content=""))) for i in sorted(choices)]

    def content(self, i: int, out: RequestOutput, c: Choice) -> bytes:
        lps = self.fmt.chat_logprobs(out.logprobs or [])
        if self.plain:
            return self.encode(r.ChatChunkChoice(i, r.Delta(content=out.text), lps))
        d = self.output(i).feed(out.text)
        if self.output(i).in_reasoning:  # (the output that ends the reasoning counts as the answer's)
            c.reasoning_tokens += len(out.token_ids)
        if not d and lps is None:
            return b""  # (all held back: markup not decided yet)
        return self.encode(r.ChatChunkChoice(i, self.delta(d), lps))

    def finish(self, i: int, reason: str | None) -> bytes:
        if self.plain:
            return self.encode(r.ChatChunkChoice(i, r.Delta(), None, reason))
        out = self.output(i)
        d = out.finish()
        last = self.encode(r.ChatChunkChoice(i, r.Delta(), None, finish_reason(reason, out.called)))
        return (self.encode(r.ChatChunkChoice(i, self.delta(d))) if d else b"") + last


def chat_choice(i: int, c: Choice, setup: ChatSetup, fmt: Formatter) -> r.ChatChoice:
    """One choice of a whole chat answer: its text split into reasoning, content and calls."""
    text = "".join(c.text)
    lps = fmt.chat_logprobs(c.logprobs)
    if setup.tools is None and setup.reasoning is None:
        return r.ChatChoice(i, r.AssistantMessage("assistant", text), lps, c.finish_reason)
    out = setup.output()
    parsed = out.parse(text)
    if setup.reasoning is not None:  # (counted as a stream counts them: ChatChunks.content)
        stream = setup.reasoning.stream()
        for piece, tokens in zip(c.text, c.pieces, strict=True):
            stream.feed(piece)
            if stream.ended:
                break
            c.reasoning_tokens += tokens
    calls = [p.ToolCallItem(k.id, p.FunctionCall(k.name, k.arguments)) for k in parsed.calls]
    msg = r.AssistantMessage("assistant", parsed.content if parsed.content or not calls else None,
                             calls or None, parsed.reasoning)
    return r.ChatChoice(i, msg, lps, finish_reason(c.finish_reason, out.called))


async def events(gen: Merged, buffered: list[tuple[int, RequestOutput]], chunks: CompletionChunks | ChatChunks,
                 n: int, count: int, usage_wanted: bool, continuous: bool = False) -> AsyncIterator[bytes]:
    """OpenAI's chunk order: [role | echo], content deltas, a finish chunk per choice, [usage], [DONE].
    With continuous (vLLM's continuous_usage_stats) every chunk carries the usage so far.

    A failure after the stream began cannot change the status any more: it is
    sent as an {"error": ...} event before [DONE].

    The events of one engine output leave in one write (one send, one syscall): the opening
    chunks with the first content, the last content with its finish chunk, the usage and
    [DONE].
    """
    choices = {i: Choice() for i in range(count)}
    chat = isinstance(chunks, ChatChunks)
    if continuous:
        chunks.running = lambda: usage(choices, n, chat)
    for i, out in buffered:  # (the first output of every choice: ServerState.start waited for them)
        choices[i].take_prompt(out)
        choices[i].prompt_tokens = out.prompt_tokens  # (known before the opening chunks)
    pending: list[bytes] = chunks.opening(choices)
    left = count
    failed = False

    def take(i: int, out: RequestOutput) -> bool:
        """Queue the events of one output; True once nothing more is to be sent before the end."""
        nonlocal left, failed
        choices[i].add(out)
        if out.error:
            if out.finish_reason == "timeout":  # what was generated stands: its end, then why
                if out.text or out.logprobs:
                    pending.append(chunks.content(i, out, choices[i]))
                pending.append(chunks.finish(i, out.finish_reason))
            pending.append(data_event(failure(out).body()))
            failed = True
            return True
        if out.text or out.logprobs:
            pending.append(chunks.content(i, out, choices[i]))
        if out.finished:
            pending.append(chunks.finish(i, out.finish_reason))
            left -= 1
        return left == 0

    def flush() -> bytes:
        pending[:] = [x for x in pending if x]  # (a chunk of held-back text is b"")
        if not pending:
            return b""
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        return data

    try:
        done = any(take(i, out) for i, out in buffered)  # (the first outputs, already here)
        if not done and pending:
            if data := flush():
                yield data
        if not failed:
            async for i, out in gen:
                # once every choice has finished nothing more comes: the loop only waits for
                # the generator's end, and the last events leave with [DONE]
                if not done:
                    done = take(i, out)
                    if failed:
                        break
                    if not done and pending:
                        if data := flush():
                            yield data
        if not failed and usage_wanted:
            pending.append(chunks.encode(use=usage(choices, n, chat)))
        pending.append(DONE_EVENT)
        yield b"".join(pending)
    finally:
        await gen.aclose()
