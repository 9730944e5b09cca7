"""An Anthropic Messages answer (/v1/messages, anthropic_api.py) built from the engine's outputs.

Its content blocks are the chat output's split (ChatOutput: reasoning, content, calls) in the
order written: thinking, text, tool_use (its input parsed). stop_reason: "tool_use" when the
answer calls tools, "max_tokens" when cut, "stop_sequence" (with the string) when one of
stop_sequences ended it, else "end_turn". Usage: input_tokens are the prompt's tokens not read
from the prefix cache, cache_read_input_tokens those that were (Anthropic counts them apart).

A stream's events: message_start, then per block content_block_start, content_block_delta
(text_delta, thinking_delta, input_json_delta) and content_block_stop, then message_delta
(stop_reason, usage) and message_stop; an error after the stream began is an `error` event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamer.messages import RequestOutput
from streamer.server.chat_output import ChatDelta, ChatSetup
from streamer.server.openai_output import Choice
from streamer.server.state import failure
from streamer.sse import data_event

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error type of an HTTP status (others: api_error)."""


@dataclass
class OpenBlock:
    kind: str
    """text, thinking or tool_use"""
    text: list[str] = field(default_factory=list)
    """The text, the thinking, or the call's input as JSON, in pieces."""
    id: str = ""
    name: str = ""


def block_body(b: OpenBlock, whole: bool) -> dict[str, Any]:
    """A content block as Anthropic writes it: whole, or (content_block_start) empty."""
    text = "".join(b.text) if whole else ""
    if b.kind == "text":
        return {"type": "text", "text": text}
    if b.kind == "thinking":
        return {"type": "thinking", "thinking": text, "signature": ""}
    return {"type": "tool_use", "id": b.id, "name": b.name, "input": json.loads(text) if whole and text else {}}


class MessageBuilder:
    """One answer's content blocks, built from the engine's outputs as they come; a stream's
    events on the way (take())."""

    def __init__(self, mid: str, model: str, setup: ChatSetup, show_thinking: bool = True,
                 streaming: bool = False) -> None:
        self.mid, self.model = mid, model
        self.streaming = streaming
        """Whether events are written (a whole message needs only the blocks)."""
        self.started = False
        self.show_thinking = show_thinking
        """thinking display "omitted": thinking blocks come, empty."""
        self.chat = setup.output()
        self.choice = Choice()
        self.blocks: list[dict[str, Any]] = []
        self.open: OpenBlock | None = None
        self.pending: list[bytes] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.streaming:
            return
        self.pending.append(b"event: " + kind.encode() + b"\n" + data_event({"type": kind, **fields}))

    def take(self) -> bytes:
        data, self.pending = b"".join(self.pending), []
        return data

    def usage(self) -> dict[str, int]:
        c = self.choice
        return {"input_tokens": c.prompt_tokens - c.cached_tokens, "output_tokens": c.completion_tokens,
                "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": 0}

    def message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage()}

    def opening(self, first: RequestOutput) -> None:
        """message_start, once, with the prompt's usage from the first output (no output yet)."""
        if not self.started:
            self.started = True
            self.choice.add(msgspec.structs.replace(first, token_ids=[], text="", completion_tokens=0, finished=False))
            self.emit("message_start", message=self.message([]))

    def start(self, kind: str, call_id: str = "", name: str = "") -> OpenBlock:
        if self.open is not None and self.open.kind == kind and kind != "tool_use":
            return self.open
        self.close()
        b = self.open = OpenBlock(kind, id=call_id, name=name)
        self.emit("content_block_start", index=len(self.blocks), content_block=block_body(b, whole=False))
        return b

    def close(self) -> None:
        b, self.open = self.open, None
        if b is None:
            return
        self.emit("content_block_stop", index=len(self.blocks))
        self.blocks.append(block_body(b, whole=True))

    def apply(self, d: ChatDelta) -> None:
        if d.reasoning:
            block = self.start("thinking")
            if self.show_thinking:
                block.text.append(d.reasoning)
                self.emit("content_block_delta", index=len(self.blocks),
                          delta={"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            self.start("text").text.append(d.content)
            self.emit("content_block_delta", index=len(self.blocks), delta={"type": "text_delta", "text": d.content})
        for call in d.calls:
            if call.name is not None:
                self.start("tool_use", call_id=call.id or "", name=call.name)
            if call.arguments and self.open is not None:
                self.open.text.append(call.arguments)
                self.emit("content_block_delta", index=len(self.blocks),
                          delta={"type": "input_json_delta", "partial_json": call.arguments})

    def feed(self, out: RequestOutput) -> None:
        self.opening(out)
        self.choice.add(out)
        self.apply(ChatDelta(content=out.text) if self.chat.plain else self.chat.feed(out.text))
        if out.finished:
            if not self.chat.plain:
                self.apply(self.chat.finish())
            self.close()
            if self.chat.called:
                self.stop_reason = "tool_use"
            elif out.finish_reason == "length":
                self.stop_reason = "max_tokens"
            elif out.stop is not None:
                self.stop_reason, self.stop_sequence = "stop_sequence", out.stop
            else:
                self.stop_reason = "end_turn"
            self.emit("message_delta", delta={"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                      usage={"output_tokens": self.choice.completion_tokens})
            self.emit("message_stop")

    def fail(self, out: RequestOutput) -> None:
        """An error after the stream began: Anthropic's error event."""
        self.opening(out)
        e = failure(out)
        self.emit("error", error={"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message})
