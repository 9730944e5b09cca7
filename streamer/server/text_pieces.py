"""Text that streams out in pieces while markup is looked for in it (tool_stream.py,
reasoning.py): what might still become a tag is held back, and a channel's text is stripped
at both ends of the whole, not of each piece."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag: what might
    still become the tag, and so must not go out yet."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Stripped:
    """One channel's output: leading whitespace dropped, trailing whitespace held until more
    text follows it (so the pieces joined equal the whole text stripped)."""

    __slots__ = ("_began", "_held", "_out")

    def __init__(self) -> None:
        self._began = False  # some non-whitespace text has gone out
        self._held = ""
        self._out: list[str] = []

    def add(self, text: str) -> None:
        if not self._began:
            text = text.lstrip()
            if not text:
                return
            self._began = True
        body = text.rstrip()
        if body:
            self._out.append(self._held + body)
            self._held = text[len(body) :]
        else:
            self._held += text

    def take(self) -> str:
        """What went out since the last take."""
        out = "".join(self._out)
        self._out = []
        return out
