"""XML tool calls whose values are written raw (tool_parsers.py registers them):

qwen3_coder, Qwen3-Coder's:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

repeated for parallel calls; glm45, GLM-4.5's (and GLM-4.6's, 4.7's):

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

A value is the text up to its close tag (one newline at
each end, which the template writes, dropped; other whitespace is the value's, as code's
indentation is), written raw: the tool's schema says what it is. A string parameter (or one the schema does not know) keeps the text; any other type is
read as JSON (a number, true, an object, ...), and stays text where it is not JSON. So the
stream needs the tools' schemas (ToolParser.with_schemas); without them every value is text.
A call whose markup breaks off is content, as in every format (tool_stream.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streamer.server.tool_stream import ToolCall, ToolStream, decode_json, new_call_id

NAME_MAX = 256
"""A function or parameter name longer than this is no markup (the text is content)."""


def _types(schema: Any) -> set[str] | None:
    """The JSON types a parameter schema allows (None: it does not say)."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "enum" in schema and isinstance(schema["enum"], list):
        return {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: set[str] = set()
            for sub in schema[key]:
                out |= _types(sub) or {"other"}
            return out
    return None


def typed(text: str, schema: Any) -> Any:
    """A raw parameter value as JSON, by its schema (the module docstring says how)."""
    types = _types(schema)
    if types is None or types == {"string"}:
        return text
    value = decode_json(text)
    if value is None and text.strip() != "null":
        return text
    if isinstance(value, str) and "string" not in types:
        return text
    return value


class XmlCallStream(ToolStream):
    """What both formats share: the call being read (its name, its typed arguments) and the
    tools' schemas that type them."""

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.schemas = schemas or {}
        self._name = ""
        self._args: dict[str, Any] = {}

    def _start(self, name: str) -> None:
        self._name, self._args = name, {}

    def _argument(self, key: str, raw: str) -> None:
        """An argument as written (its padding newlines dropped), typed by the tool's schema."""
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        params = self.schemas.get(self._name)
        props = params.get("properties") if isinstance(params, dict) else None
        self._args[key] = typed(raw, props.get(key) if isinstance(props, dict) else None)

    def _done(self) -> None:
        self._emit(ToolCall(new_call_id(), self._name, json.dumps(self._args, ensure_ascii=False)))
        self._state = "text"


class Qwen3CoderStream(XmlCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"

    def _header(self, rest: str, tag: str, final: bool) -> tuple[str, int] | bool:
        """(name, length) of `tag`NAME`>` at the head of rest; False: wait for more text;
        True: not this markup (the caller fails)."""
        if not rest.startswith(tag):
            return not (tag.startswith(rest) and not final)
        close = rest.find(">", len(tag))
        if close < 0:
            return final or len(rest) > len(tag) + NAME_MAX
        name = rest[len(tag) : close].strip()
        if not name or len(name) > NAME_MAX or any(c in name for c in "<\n"):
            return True
        return name, close + 1

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._text_until(self.OPEN, "open", final)
        rest = buf.lstrip()
        skip = len(buf) - len(rest)
        if self._state in ("open", "parameters"):  # a <function=NAME> header, or the next argument
            opening = self._state == "open"
            if not opening and rest.startswith(self.FUNCTION_END):
                self._hold(skip + len(self.FUNCTION_END), "close")
                return True
            if not opening and not final and self.FUNCTION_END.startswith(rest):  # (nothing yet, "<", "</f"...)
                return False
            head = self._header(rest, self.FUNCTION if opening else self.PARAMETER, final)
            if head is False:
                return False
            if head is True:
                self._fail("text")
                return True
            assert not isinstance(head, bool)
            name, at = head
            if opening:
                self._start(name)
                self._hold(skip + at, "parameters")
                return True
            end = rest.find(self.PARAMETER_END, at)
            if end < 0:
                if final:
                    self._fail("text")
                return final
            self._argument(name, rest[at:end])
            self._hold(skip + end + len(self.PARAMETER_END), "parameters")
            return True
        # "close": the call is complete; consume its </tool_call> when it comes
        if not final and len(rest) < len(self.CLOSE) and self.CLOSE.startswith(rest):
            return False
        if rest.startswith(self.CLOSE):
            self._take(skip + len(self.CLOSE))
        elif self.CLOSE.startswith(rest):
            self._take(len(buf))  # a close tag cut off by the end of output
        self._done()
        return True


class Glm45Stream(XmlCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    MARKERS = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)

    def _between(self, rest: str, tag: str, end: str, final: bool) -> tuple[str, int] | bool:
        """(text, length) of `tag`TEXT`end` at the head of rest; False: wait; True: not it."""
        if not rest.startswith(tag):
            return not (tag.startswith(rest) and not final)
        close = rest.find(end, len(tag))
        if close < 0:
            return final
        return rest[len(tag) : close], close + len(end)

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._text_until(self.OPEN, "name", final)
        if self._state == "name":  # NAME, up to a newline or the first argument (or the close)
            ends = [i for i in (buf.find("\n"), buf.find(self.KEY), buf.find(self.CLOSE)) if i >= 0]
            if not ends:
                if final or len(buf) > NAME_MAX:
                    self._fail("text")
                    return True
                return False
            name = buf[: min(ends)].strip()
            if not name or len(name) > NAME_MAX or any(c in name for c in "<>"):
                self._fail("text")
                return True
            self._start(name)
            self._hold(min(ends), "arguments")
            return True
        rest = buf.lstrip()
        skip = len(buf) - len(rest)
        if rest.startswith(self.CLOSE):
            self._take(skip + len(self.CLOSE))
            self._done()
            return True
        if not final and self.CLOSE.startswith(rest):
            return False
        key = self._between(rest, self.KEY, self.KEY_END, final)
        if key is False:
            return False
        if key is True:
            if final and rest == "":  # a call cut off by the end of output before its close tag
                self._done()
                return True
            self._fail("text")
            return True
        assert not isinstance(key, bool)
        after = rest[key[1] :]
        value_at = key[1] + len(after) - len(after.lstrip())
        value = self._between(rest[value_at:], self.VALUE, self.VALUE_END, final)
        if value is False:
            return False
        if value is True:
            self._fail("text")
            return True
        assert not isinstance(value, bool)
        self._argument(key[0].strip(), value[0])
        self._hold(skip + value_at + value[1], "arguments")
        return True
