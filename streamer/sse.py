"""Reading Server-Sent Events on the client side (benchmarks, the language's HTTP
backend, the locustfile, tests): one definition of the `data:` framing."""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"
"""What parse_line returns for the stream's end marker."""


def parse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON of a `data: {...}` line, DONE for `data: [DONE]`, None for any other line
    (blank separators, comments, other fields)."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    return DONE if data == DONE else json.loads(data)
