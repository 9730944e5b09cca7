"""Routing keys: the string a request is routed on, its prompt as the replica will see it.

Why text, not tokens: the server process does not tokenize (server/state.py: the engine's
tokenizer does, in the engine process), and the standalone router has no model at all;
tokenizing in the router would cost an extra pass over every prompt (or a round trip to a
worker's /tokenize) for a ranking that text ranks as well: two prompts share a token prefix
where they share a text prefix, give or take the token at the seam. SGLang's router routes
on text for the same reasons. Prompts given as token ids are keyed on the ids themselves
(each id one character, after a mark that no text key starts with).

A chat request is keyed on its tools and messages in order, each message's role and text
content, separated by control characters: the chat template renders them in this order, so
two conversations that share their first messages share a key prefix (the template's
own text is the same for all and adds nothing to the ranking).

Keys are cut at MAX_KEY_CHARS: prompts that share so long a head belong together anyway,
and the cut bounds the router's work per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from streamer.messages import GenerateRequest

MAX_KEY_CHARS = 1 << 16
TOKENS = "\x00"
"""Marks a key of token ids (no text key starts with NUL: text keys start with \x01 or \x02)."""
TEXT = "\x01"
CHAT = "\x02"
_MAX_CHAR = 0x110000


def token_key(ids: Sequence[int]) -> str:
    return (TOKENS + "".join(chr(t % _MAX_CHAR) for t in ids[: MAX_KEY_CHARS]))[:MAX_KEY_CHARS]


def text_key(text: str) -> str:
    return (TEXT + text)[:MAX_KEY_CHARS]


def chat_key(messages: Sequence[Any], tools: Sequence[Any] | None = None) -> str:
    parts = [CHAT]
    if tools:
        parts.append(json.dumps(tools, sort_keys=True, default=str) + "\x1d")
    for m in messages:
        if not isinstance(m, dict):
            continue
        parts.append(f"{m.get('role', '')}\x1f{_content(m.get('content'))}\x1e")
        if sum(map(len, parts)) >= MAX_KEY_CHARS:
            break
    return "".join(parts)[:MAX_KEY_CHARS]


def _content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # OpenAI content parts: their text, in order
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content, sort_keys=True, default=str)


def request_key(req: GenerateRequest) -> str:
    """The key of an engine request (DataParallelEngine)."""
    if req.prompt_token_ids is not None:
        return token_key(req.prompt_token_ids)
    if req.messages is not None:
        return chat_key(req.messages, req.tools)
    return text_key(req.prompt or "")


def body_key(path: str, body: Any) -> str:
    """The key of an HTTP request's JSON body (the standalone router): chat messages (a
    response's input: responses_key), a
    completion's prompt (a batch of prompts: the first; they go to one worker together), the
    native API's text or input_ids; "" when the body has none (then load alone decides)."""
    if not isinstance(body, dict):
        return ""
    if path == "/v1/responses":
        return responses_key(body)
    if path.startswith("/v1/messages") and isinstance(body.get("messages"), list):  # (Anthropic's: system apart)
        system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
        return chat_key(system + body["messages"], body.get("tools") if isinstance(body.get("tools"), list) else None)
    if isinstance(body.get("messages"), list):
        return chat_key(body["messages"], body.get("tools") if isinstance(body.get("tools"), list) else None)
    for field in ("prompt", "text", "input_ids", "input"):  # (input: /v1/embeddings')
        if field in body:
            return _prompt_key(body[field])
    return ""


def responses_key(body: dict[str, Any]) -> str:
    """A /v1/responses body's key: its instructions and input items as the chat messages they
    render as (an item without a role: its type, and its output or arguments as the text)."""
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list):
        return ""
    messages: list[Any] = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    for item in items:
        if isinstance(item, dict) and "role" not in item:
            item = {"role": item.get("type", ""), "content": item.get("output", item.get("arguments"))}
        messages.append(item)
    return chat_key(messages, body.get("tools") if isinstance(body.get("tools"), list) else None)


def _prompt_key(prompt: Any) -> str:
    if isinstance(prompt, str):
        return text_key(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return token_key(prompt)
        return _prompt_key(prompt[0])
    return ""


SESSION_PREFIX = "ws-"
"""A WebSocket turn's request id is session_request_id(session, turn): "ws-<session>-<turn>"."""


def session_request_id(session: str, turn: int) -> str:
    """The request id of a session's turn; DataParallelEngine reads the session back from it."""
    return f"{SESSION_PREFIX}{session}-{turn}"


def session_of(request_id: str) -> str | None:
    if not request_id.startswith(SESSION_PREFIX):
        return None
    session, _, turn = request_id[len(SESSION_PREFIX) :].rpartition("-")
    return session if session and turn.isdigit() else None
