"""A Responses API answer (/v1/responses, responses_api.py) built from the engine's outputs.

The items are the chat output's split (ChatOutput: reasoning, content, calls), in the order
the model wrote them: a reasoning item, a message with one output_text, a function_call item
per call. A whole response and a stream come from the same builder, so the stream's last
event carries the whole response's body.

The stream: SSE events named by their type, each with its sequence_number:
response.created, response.in_progress; for each item output_item.added, then
  message: content_part.added, output_text.delta..., output_text.done, content_part.done
  reasoning: content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
  function_call: function_call_arguments.delta, function_call_arguments.done
and output_item.done; last response.completed, response.incomplete (max_output_tokens
reached: incomplete_details.reason) or response.failed (an error after the stream began).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from streamer.messages import RequestOutput
from streamer.server import responses as r
from streamer.server.chat_output import ChatDelta, ChatSetup
from streamer.server.openai_output import Choice, Formatter
from streamer.server.state import failure
from streamer.sse import data_event


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class OpenItem:
    """The output item being streamed: what it has gathered so far."""

    kind: str
    """message, reasoning or function_call"""
    id: str
    text: list[str] = field(default_factory=list)
    """The message's text, the reasoning, or the call's arguments, in pieces."""
    logprobs: list[r.TokenLogprob] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseBuilder:
    """One response's output items, built from the engine's outputs as they come; the events
    of a stream on the way (taken with take())."""

    def __init__(self, response: r.ResponseObject, setup: ChatSetup, fmt: Formatter, logprobs: bool,
                 streaming: bool = False) -> None:
        self.response = response
        self.streaming = streaming
        """Whether events are written (a whole response needs only the items)."""
        self.opened = False
        self.chat = setup.output()
        self.fmt, self.logprobs = fmt, logprobs
        self.choice = Choice()
        self.reasoning_tokens = 0
        self.seq = 0
        self.pending: list[bytes] = []
        self.item: OpenItem | None = None

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.streaming:
            return
        self.pending.append(b"event: " + kind.encode() + b"\n" +
                            data_event({"type": kind, "sequence_number": self.seq, **fields}))
        self.seq += 1

    def take(self) -> bytes:
        data, self.pending = b"".join(self.pending), []
        return data

    def opening(self) -> None:
        """The stream's first events (once, before the first output's)."""
        if not self.opened:
            self.opened = True
            self.emit("response.created", response=self.response)
            self.emit("response.in_progress", response=self.response)

    # ---- items

    @property
    def index(self) -> int:
        """The open item's output_index."""
        return len(self.response.output)

    def open(self, kind: str, call_id: str = "", name: str = "") -> OpenItem:
        """The open item if it is of this kind (a call is never continued), else a new one."""
        if self.item is not None and self.item.kind == kind and kind != "function_call":
            return self.item
        self.close("completed")
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = self.item = OpenItem(kind, new_id(prefix), call_id=call_id, name=name)
        at = {"output_index": self.index}
        if kind == "message":
            self.emit("response.output_item.added", **at, item=r.MessageItem(item.id, "in_progress", "assistant", []))
            self.emit("response.content_part.added", **at, item_id=item.id, content_index=0, part=r.OutputText(""))
        elif kind == "reasoning":
            self.emit("response.output_item.added", **at, item=r.ReasoningItem(item.id, [], [], "in_progress"))
            self.emit("response.content_part.added", **at, item_id=item.id, content_index=0, part=r.ReasoningText(""))
        else:
            self.emit("response.output_item.added", **at,
                      item=r.FunctionCallItem(item.id, call_id, name, "", "in_progress"))
        return item

    def close(self, status: str) -> None:
        """Finish the open item (status: its own, completed or incomplete)."""
        item, self.item = self.item, None
        if item is None:
            return
        text = "".join(item.text)
        at = {"output_index": self.index, "item_id": item.id}
        done: r.OutputItem
        if item.kind == "message":
            part = r.OutputText(text, logprobs=item.logprobs)
            self.emit("response.output_text.done", **at, content_index=0, text=text, logprobs=part.logprobs)
            self.emit("response.content_part.done", **at, content_index=0, part=part)
            done = r.MessageItem(item.id, status, "assistant", [part])
        elif item.kind == "reasoning":
            self.emit("response.reasoning_text.done", **at, content_index=0, text=text)
            self.emit("response.content_part.done", **at, content_index=0, part=r.ReasoningText(text))
            done = r.ReasoningItem(item.id, [], [r.ReasoningText(text)], status)
        else:
            self.emit("response.function_call_arguments.done", **at, name=item.name, arguments=text)
            done = r.FunctionCallItem(item.id, item.call_id, item.name, text, status)
        self.emit("response.output_item.done", output_index=self.index, item=done)
        self.response.output.append(done)

    def apply(self, d: ChatDelta, out: RequestOutput) -> None:
        if d.reasoning:
            item = self.open("reasoning")
            item.text.append(d.reasoning)
            self.emit("response.reasoning_text.delta", output_index=self.index, item_id=item.id, content_index=0,
                      delta=d.reasoning)
        lps = self.fmt.chat_logprobs(out.logprobs or []) if self.logprobs else None
        if d.content or lps is not None:
            item = self.open("message")
            item.text.append(d.content)
            tokens = (lps.content or []) if lps is not None else []
            item.logprobs.extend(tokens)
            self.emit("response.output_text.delta", output_index=self.index, item_id=item.id, content_index=0,
                      delta=d.content, logprobs=tokens)
        for call in d.calls:
            if call.name is not None:  # (a call's first delta: its id and name)
                self.open("function_call", call_id=call.id or "", name=call.name)
            open_call = self.item
            if call.arguments and open_call is not None:
                open_call.text.append(call.arguments)
                self.emit("response.function_call_arguments.delta", output_index=self.index, item_id=open_call.id,
                          delta=call.arguments)

    # ---- outputs

    def feed(self, out: RequestOutput) -> None:
        """One engine output (not an error: fail() takes those)."""
        self.opening()
        self.choice.add(out)
        d = ChatDelta(content=out.text) if self.chat.plain else self.chat.feed(out.text)
        if self.chat.in_reasoning:
            self.reasoning_tokens += len(out.token_ids)
        self.apply(d, out)
        if out.finished:
            self.finish(out.finish_reason)

    def usage(self) -> r.ResponseUsage:
        c = self.choice
        return r.ResponseUsage(c.prompt_tokens, r.InputTokensDetails(c.cached_tokens), c.completion_tokens,
                               r.OutputTokensDetails(self.reasoning_tokens), c.prompt_tokens + c.completion_tokens)

    def finish(self, reason: str | None) -> None:
        if not self.chat.plain:
            self.apply(self.chat.finish(), RequestOutput("", [], ""))
        if self.item is None and not self.response.output:
            self.open("message")  # (an empty answer is still a message)
        cut = reason in ("length", "abort")
        self.close("incomplete" if cut else "completed")
        self.response.usage = self.usage()
        if reason == "length":
            self.response.status, self.response.incomplete_details = "incomplete", r.IncompleteDetails(
                "max_output_tokens")
            self.emit("response.incomplete", response=self.response)
        elif reason == "abort":  # (the server shutting down: what was generated stands)
            self.response.status = "cancelled"
            self.response.error = r.ResponseError("cancelled", "the request was aborted before it finished")
            self.emit("response.failed", response=self.response)
        else:
            self.response.status = "completed"
            self.emit("response.completed", response=self.response)

    def fail(self, out: RequestOutput) -> None:
        """An error after the stream began: what was generated stands; response.failed says why."""
        self.opening()
        if out.text:
            self.apply(ChatDelta(content=out.text) if self.chat.plain else self.chat.feed(out.text), out)
        self.close("incomplete")
        e = failure(out)
        self.choice.add(out)
        self.response.usage = self.usage()
        self.response.status = "failed"
        self.response.error = r.ResponseError(e.code or "server_error", e.message)
        self.emit("response.failed", response=self.response)
