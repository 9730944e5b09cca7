"""Request limits, checked before any work starts (tokenizing, templating, submitting).

Every limit is a ServerConfig field of the same name with a `streamer serve` flag
(max_stop -> --max-stop). A request over one is answered 400, code "limit_exceeded",
with a message that names the field, the limit and the flag, so that the user knows
what to shorten and the operator what to raise.

Why each exists: the work a request causes must stay bounded whatever it sends,
because some of that work is serial for everyone. The engine's tokenizer actor
tokenizes one request at a time (a 50 MB prompt held every other request for
minutes); stop strings are searched at every token on the detokenizer's event loop,
logit_bias entries looped over at every step of the batch a bystander shares, and
chat templates rendered in the server's own process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from streamer.config import ServerConfig
from streamer.server.protocol import ApiError, SamplingFields

CHARS_PER_TOKEN = 32
"""max_prompt_chars defaults to this many characters per token of the context. Real text
averages 3-5 characters a token, and SmolLM2's longest token is 81 characters (a run of
spaces), so a prompt that fits the context practically never reaches it, while the
tokenizer's work stays bounded (262,144 characters for 8,192 tokens: ~0.5 s on one core)."""


class Limits:
    """The limits of one server: ServerConfig's max_* fields, max_prompt_chars resolved."""

    def __init__(self, config: ServerConfig, max_model_len: int) -> None:
        self.config = config
        self.max_prompt_chars = config.max_prompt_chars or CHARS_PER_TOKEN * max_model_len

    def value(self, field: str) -> int:
        return self.max_prompt_chars if field == "max_prompt_chars" else getattr(self.config, field)

    def at_most(self, size: int, field: str, what: str, param: str | None = None) -> None:
        """Refuse when size > the limit `field`; `what` says what was counted ("stop strings")."""
        limit = self.value(field)
        if size > limit:
            flag = "--" + field.replace("_", "-")
            raise ApiError(f"{param or 'the request'}: {size:,} {what}, more than the limit of {limit:,} "
                           f"(streamer serve {flag})", param=param, code="limit_exceeded")

    # ---- pieces of requests ------------------------------------------------------------

    def stop(self, stop: str | Sequence[str] | None, stop_token_ids: Sequence[int] | None, prefix: str = "") -> None:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        self.at_most(len(strings), "max_stop", "stop strings", prefix + "stop")
        self.at_most(max(map(len, strings), default=0), "max_stop_chars", "characters in a stop string",
                     prefix + "stop")
        self.at_most(len(stop_token_ids or ()), "max_stop", "stop token ids", prefix + "stop_token_ids")

    def choices(self, choices: Sequence[str] | None, param: str) -> None:
        self.at_most(len(choices or ()), "max_choices", "choices", param)

    def sampling(self, body: SamplingFields) -> None:
        """The fields of SamplingFields (OpenAI routes and WebSocket turns) that cost work per token."""
        self.at_most(body.n, "max_n", "choices (n)", "n")
        self.stop(body.stop, body.stop_token_ids)
        words = body.bad_words or []  # (tokenized like stop strings, checked at every step: the same limits)
        self.at_most(len(words), "max_stop", "bad words", "bad_words")
        self.at_most(max(map(len, words), default=0), "max_stop_chars", "characters in a bad word", "bad_words")
        self.at_most(len(body.logit_bias or ()), "max_logit_bias", "logit_bias entries", "logit_bias")
        self.choices(body.guided_choice, "guided_choice")

    def batch(self, count: int, param: str, what: str = "prompts") -> None:
        self.at_most(count, "max_batch", what, param)

    def prompts(self, texts: Sequence[str | Any], param: str) -> None:
        """The characters of every text prompt of one request, summed (token-id prompts count 0):
        they are tokenized one after another, each delaying the requests behind it."""
        self.at_most(sum(len(t) for t in texts if isinstance(t, str)), "max_prompt_chars",
                     "characters of prompt", param)

    def messages(self, messages: Sequence[dict[str, Any]], param: str = "messages") -> int:
        """A chat: the message count, and the characters of its contents summed; returns those characters."""
        self.at_most(len(messages), "max_messages", "messages", param)
        try:
            chars = sum(content_chars(m) for m in messages)
        except RecursionError:
            raise ApiError(f"{param}: a message nests too deeply", param=param) from None
        self.at_most(chars, "max_prompt_chars", "characters of message content", param)
        return chars


def content_chars(message: Any) -> int:
    """A message's content in characters; content that is not text (a list of parts, say)
    counts as the length of its JSON, about what a template can render from it."""
    content = message.get("content") if isinstance(message, dict) else message
    if content is None or isinstance(content, str):
        return len(content or "")
    return len(msgspec.json.encode(content))
