"""The model's chat template, rendered one turn at a time.

A program's text is the truth; the chat state only keeps the messages so far
so that the template can say what text opens and closes the next turn. For a
turn of role r after messages M:

    before = render(M)
    after  = render(M + [{"role": r, "content": SENTINEL}])
    after == before + begin + SENTINEL + end

begin (e.g. "<|im_start|>user\\n", plus a default system turn some templates
add before the first message) is appended when the turn opens; end (e.g.
"<|im_end|>\\n") when it closes, and the turn's text between the two becomes
the message's content. So the text of a program that uses only role helpers
equals the template applied to its messages, token for token, and a turn's
content may be generated (assistant(gen(...))).

A template that does not render incrementally (before is not a prefix of
after: e.g. one that rewrites earlier turns depending on what follows) is
refused with an error that says so.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

SENTINEL = "\u2063STREAMER-TURN-CONTENT\u2063"

Render = Callable[[list[list[dict[str, Any]]]], Awaitable[list[str]]]
"""Render several conversations (add_generation_prompt=False); an empty one renders as ""."""


@dataclass
class OpenTurn:
    role: str
    end: str
    start: int
    """Offset in the state's text where the turn's content starts."""


@dataclass
class ChatState:
    messages: list[dict[str, Any]] = field(default_factory=list)
    open: list[OpenTurn] = field(default_factory=list)

    def copy(self) -> ChatState:
        return ChatState(copy.deepcopy(self.messages), list(self.open))

    async def begin(self, render: Render, role: str, text_len: int) -> str:
        """Open a turn after text_len characters of text: returns the text that opens it (the caller appends it)."""
        if self.open:
            raise ValueError(f"{role}_begin() inside an open {self.open[-1].role} turn; close it first")
        before, after = await render([self.messages, [*self.messages, {"role": role, "content": SENTINEL}]])
        if not after.startswith(before) or after.count(SENTINEL) != 1:
            raise ValueError("this model's chat template does not render turn by turn; "
                             "build the prompt as text instead of with role helpers")
        begin, _, end = after[len(before):].partition(SENTINEL)
        self.open.append(OpenTurn(role, end, text_len + len(begin)))
        return begin

    def end(self, role: str, text: str) -> str:
        """Close the open turn given the state's whole text; returns the text that closes it."""
        if not self.open or self.open[-1].role != role:
            opened = self.open[-1].role if self.open else "no"
            raise ValueError(f"{role}_end() but {opened} turn is open")
        turn = self.open.pop()
        self.messages.append({"role": role, "content": text[turn.start:]})
        return turn.end
