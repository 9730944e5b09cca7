"""Compiling one grammar spec: what the engine (grammar.py) and the trial process
(grammar_worker.py) both run, so that neither imports the other.

Spec kinds (messages.GrammarSpec): json_object, json_schema, regex, ebnf, choice
(grammar.py's docstring says what each means).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamer.errors import RequestError

if TYPE_CHECKING:
    import xgrammar as xgr

KINDS = ("json_object", "json_schema", "regex", "ebnf", "choice")


def clean_error(err: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp, a source path and a check text; drop them."""
    msg = str(err).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(err).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly the given literals (JSON escapes are EBNF escapes)."""
    alts = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(json.dumps(c) for c in alts)


def build(c: xgr.GrammarCompiler, kind: str, value: str, any_whitespace: bool) -> xgr.CompiledGrammar:
    """Compile one spec (here and in the trial process); RequestError for what is not valid."""
    if kind == "json_object":
        return c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"invalid json_schema: not JSON ({e})") from None
        except RecursionError:
            raise RequestError("invalid json_schema: it nests too deeply") from None
        if not isinstance(schema, dict | bool):
            raise RequestError("invalid json_schema: a schema must be a JSON object")
        return c.compile_json_schema(value, any_whitespace=any_whitespace)
    if kind == "regex":
        return c.compile_regex(value)
    if kind == "ebnf":
        return c.compile_grammar(value)
    if kind == "choice":
        try:
            choices = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"invalid choice: not a JSON list of strings ({e})") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(s, str) for s in choices):
            raise RequestError("invalid choice: give a non-empty JSON list of strings")
        if not all(choices):
            raise RequestError("invalid choice: the choices must not be empty strings")
        return c.compile_grammar(choice_grammar(choices))
    raise RequestError(f"unknown grammar kind {kind!r}; use one of {', '.join(KINDS)}")
