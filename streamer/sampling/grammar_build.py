"""Compiling one grammar spec: what the engine (grammar.py) and the trial process
(grammar_worker.py) both run, so that neither imports the other.

Spec kinds (messages.GrammarSpec): json_object, json_schema, regex, ebnf, choice,
structural_tag (grammar.py's docstring says what each means).

JSON inside a structural tag follows the same whitespace policy as a json_schema spec:
with any_whitespace off, each plain `json_schema` element (style "json", no any_order,
excludes or max_whitespace_cnt of its own) is compiled as the fixed-format grammar that
compile_json_schema would use, so tool-call arguments are as compact, and as forced for
jump-forward, as any other JSON the engine writes. An element that sets one of those
fields keeps xgrammar's own (free-whitespace) JSON.

format_of(kind, value) turns any spec into a structural-tag format element with the same
language, so a spec can be embedded in a larger structural tag (server/tool_grammar.py's
after_reasoning does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from streamer.errors import RequestError

if TYPE_CHECKING:
    import xgrammar as xgr

KINDS = ("json_object", "json_schema", "regex", "ebnf", "choice", "structural_tag")
_OWN_JSON_FIELDS = ("any_order", "excludes", "max_whitespace_cnt")
"""A json_schema element that sets one of these keeps xgrammar's own JSON (see the docstring)."""


def clean_error(err: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp, a source path and a check text; drop them."""
    msg = str(err).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    msg = re.sub(r"^Invalid (structural tag|JSON) error:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(err).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly the given literals (JSON escapes are EBNF escapes)."""
    alts = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(json.dumps(c) for c in alts)


def _json(kind: str, value: str, what: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RequestError(f"invalid {kind}: not {what} ({e})") from None
    except RecursionError:
        raise RequestError(f"invalid {kind}: it nests too deeply") from None


def parse_schema(value: str) -> dict | bool:
    schema = _json("json_schema", value, "JSON")
    if not isinstance(schema, dict | bool):
        raise RequestError("invalid json_schema: a schema must be a JSON object")
    return schema


def parse_choices(value: str) -> list[str]:
    choices = _json("choice", value, "a JSON list of strings")
    if not isinstance(choices, list) or not choices or not all(isinstance(s, str) for s in choices):
        raise RequestError("invalid choice: give a non-empty JSON list of strings")
    if not all(choices):
        raise RequestError("invalid choice: the choices must not be empty strings")
    return choices


def parse_structural_tag(value: str) -> dict:
    """The structural tag as a dict: {"type": "structural_tag", "format": {...}}."""
    tag = _json("structural_tag", value, "JSON")
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise RequestError('invalid structural_tag: give {"type": "structural_tag", "format": {...}}')
    if tag.get("type", "structural_tag") != "structural_tag":
        raise RequestError(f'invalid structural_tag: its type must be "structural_tag", not {tag["type"]!r}')
    return tag


def format_of(kind: str, value: str) -> dict:
    """A structural-tag format element whose language is the spec's (RequestError if invalid)."""
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": parse_schema(value)}
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": value}
    if kind == "choice":
        return {"type": "grammar", "grammar": choice_grammar(parse_choices(value))}
    if kind == "structural_tag":
        return parse_structural_tag(value)["format"]
    raise RequestError(f"unknown grammar kind {kind!r}; use one of {', '.join(KINDS)}")


def fixed_json(fmt: Any) -> Any:
    """fmt with its plain json_schema elements replaced by fixed-format JSON grammars."""
    import xgrammar as xgr

    if isinstance(fmt, list):
        return [fixed_json(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if (fmt.get("type") == "json_schema" and "json_schema" in fmt and fmt.get("style", "json") == "json"
            and not any(fmt.get(k) for k in _OWN_JSON_FIELDS)):
        schema = json.dumps(fmt.get("json_schema"))
        return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))}
    return {k: v if k == "json_schema" else fixed_json(v) for k, v in fmt.items()}


def _structural_tag(c: xgr.GrammarCompiler, value: str, any_whitespace: bool) -> xgr.CompiledGrammar:
    tag = parse_structural_tag(value)
    try:
        if not any_whitespace:
            tag = {**tag, "format": fixed_json(tag["format"])}
        return c.compile_structural_tag(json.dumps(tag))
    except RecursionError:
        raise RequestError("invalid structural_tag: it nests too deeply") from None
    except RuntimeError as e:  # how xgrammar reports a bad tag (or a bad schema, regex, grammar in it)
        raise RequestError(f"invalid structural_tag: {clean_error(e)}") from None


def build(c: xgr.GrammarCompiler, kind: str, value: str, any_whitespace: bool) -> xgr.CompiledGrammar:
    """Compile one spec (here and in the trial process); RequestError for what is not valid."""
    if kind == "json_object":
        return c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
    if kind == "json_schema":
        parse_schema(value)
        return c.compile_json_schema(value, any_whitespace=any_whitespace)
    if kind == "regex":
        return c.compile_regex(value)
    if kind == "ebnf":
        return c.compile_grammar(value)
    if kind == "choice":
        return c.compile_grammar(choice_grammar(parse_choices(value)))
    if kind == "structural_tag":
        return _structural_tag(c, value, any_whitespace)
    raise RequestError(f"unknown grammar kind {kind!r}; use one of {', '.join(KINDS)}")
