"""Grammars for OpenAI tool calls, and for an answer that follows a reasoning block.

  FORMATS                                   the tool-call markups below
  tool_call_grammar(tools, tool_choice, parallel_tool_calls, fmt) -> GrammarSpec | None
  after_reasoning(spec, end="</think>", start="<think>") -> GrammarSpec

Pure functions of request data (no server state), in one module because they compose:
after_reasoning(tool_call_grammar(...)) constrains a reasoning model's calls. Both return
structural_tag specs, which the engine compiles like any spec (on trial, under limits).
Errors a client caused are RequestError (a 400), naming what was wrong.

A call, per format (NAME: the tool's name as a JSON string; ARGS: JSON of the tool's
`parameters` schema, {"type": "object"} when it has none; JSON whitespace as for any
json_schema spec, grammar_build.py says how):

  hermes        <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>   calls joined by "\\n"
  llama3_json   {"name": NAME, "parameters": ARGS}                             calls joined by "; "
  mistral       [TOOL_CALLS][{"name": NAME, "arguments": ARGS}, ...]           one array of all calls
  deepseek_v3   CALLS_BEGIN (CALL_BEGIN function SEP N \n```json\n ARGS \n``` CALL_END)+ CALLS_END   joined by "\n"
  deepseek_v31  CALLS_BEGIN (CALL_BEGIN N SEP ARGS CALL_END)+ CALLS_END        calls joined by ""
  qwen3_coder   <tool_call>\n<function=N>\n XML </function>\n</tool_call>      calls joined by "\n"
                (XML: `<parameter=KEY>\nVALUE\n</parameter>\n` per argument, the values
                raw, xgrammar's json_schema style "qwen_xml"; N bare: no whitespace, < or >)
  glm45         <tool_call>N\n XML </tool_call>                              calls joined by "\n"
                (XML: `<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n` per argument,
                xgrammar's style "glm_xml")

(DeepSeek's: N is the tool's name as written, not a JSON string, so it may hold neither
whitespace nor "｜", the marker's bar: RequestError for a tool whose name does; the markers
are chat_template.DEEPSEEK_MARKERS, "<｜tool▁calls▁begin｜>" and so on.)

tool_choice:

  (openai, gpt-oss's harmony: no grammar; "required" and a named function are refused.)

  "none"        None: no constraint.
  "auto"        Free text, then optionally the calls, then the end of the output. The text
                ends where the format's trigger first appears ("<tool_call>", '{"name": ',
                "[TOOL_CALLS]", CALLS_BEGIN); from there the calls are constrained as for "required".
                llama3_json has no begin token, so its trigger is the call's own opening:
                plain text cannot contain '{"name": ' (it would start a call). None when
                there are no tools (nothing to call).
  "required"    The calls and nothing else: exactly one, or one or more when
                parallel_tool_calls.
  {"type": "function", "function": {"name": N}}   exactly one call, of N.

After the calls the grammar is complete, so the stop token (the model's EOS) ends the
output. A tool's "strict" is not read: the arguments always follow its schema.

NOTE how a block of calls is built. All three formats lay calls out as
OPEN CALL (SEP CALL)* CLOSE with CALL = `{"name": NAME, "KEY": ARGS}`. xgrammar's
tags_with_separator matches CALL (SEP CALL)*, and a tag around it adds OPEN and CLOSE;
but a tag around such (unlimited) content needs a non-empty end, and llama3_json's CLOSE
is empty. So the braces move out of the calls: each tool's tag is `NAME, "KEY": ` + ARGS,
the block's begin is OPEN + '{"name": ', the separator '}' + SEP + '{"name": ', the end
'}' + CLOSE (never empty). The language is the same; each tool's tag is one of the
alternatives after '{"name": ', so the name is an enumeration of the tools' names.
DeepSeek's calls are tags of their own (their begin names the tool, their end is CALL_END),
so they need no such move: the block is a tag CALLS_BEGIN ... CALLS_END around them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from streamer.chat_template import DEEPSEEK_MARKERS
from streamer.errors import RequestError
from streamer.messages import GrammarSpec
from streamer.sampling.grammar_build import format_of

FORMATS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45")
UNCONSTRAINED = "openai"
"""gpt-oss's harmony calls (tool_parsers.py): no grammar is built for them (the calls come
after analysis messages, in markup of special tokens); "none" and "auto" only."""
_HEAD = '{"name": '
_WHITESPACE = {"type": "grammar", "grammar": "root ::= [ \\t\\n\\r]*"}


@dataclass(frozen=True, slots=True)
class _Markup:
    trigger: str
    """Where "auto" text gives way to the calls (a prefix of open + _HEAD)."""
    open: str
    """Before the first call's JSON object."""
    key: str
    """The arguments' key in a call's JSON object."""
    sep: str
    """Between one call's JSON object and the next."""
    close: str
    """After the last call's JSON object."""


_MARKUP = {
    "hermes": _Markup("<tool_call>", "<tool_call>\n", "arguments", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
    "llama3_json": _Markup(_HEAD, "", "parameters", "; ", ""),
    "mistral": _Markup("[TOOL_CALLS]", "[TOOL_CALLS][", "arguments", ", ", "]"),
}

_CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP = DEEPSEEK_MARKERS


@dataclass(frozen=True, slots=True)
class _Tagged:
    """A format whose calls are tags: call_head NAME call_mid ARGS call_end, joined by sep,
    between the block's open (also the "auto" trigger) and close."""

    call_head: str
    call_mid: str
    call_end: str
    sep: str
    open: str = _CALLS_BEGIN
    close: str = _CALLS_END
    style: str = "json"
    """How ARGS is written: JSON, or "qwen_xml" (xgrammar's json_schema styles)."""
    forbidden: str = _SEP[1]
    """Characters a bare name may not hold (besides whitespace): they would end it."""

    @property
    def trigger(self) -> str:
        return self.open


XML_WHITESPACE = 2
"""Whitespace characters in a row that an XML style's markup may hold (between parameters, around a
value: the templates write one newline): a small model must not wander into whitespace there until
max_tokens, as JSON's fixed format keeps it from doing (sampling/grammar.py). A string value's own
whitespace (code's indentation) is not bounded."""


_TAGGED = {
    "deepseek_v3": _Tagged(_CALL_BEGIN + "function" + _SEP, "\n```json\n", "\n```" + _CALL_END, "\n"),
    "deepseek_v31": _Tagged(_CALL_BEGIN, _SEP, _CALL_END, ""),
    # (as Qwen3-Coder's template writes a call: each argument's block ends with a newline)
    "qwen3_coder": _Tagged("<function=", ">\n", "</function>", "\n</tool_call>\n<tool_call>\n", "<tool_call>\n",
                           "\n</tool_call>", style="qwen_xml", forbidden="<>"),
    # (the name right after <tool_call>; its arguments' tags, xgrammar's glm_xml, bound the call)
    "glm45": _Tagged("", "", "", "</tool_call>\n<tool_call>", "<tool_call>", "</tool_call>", style="glm_xml",
                     forbidden="<>"),
}


def _functions(tools: Any) -> dict[str, dict | bool]:
    """Each function tool's name and parameters schema, in the order given (None: no tools)."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of tools")
    out: dict[str, dict | bool] = {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}]: unsupported tool type {kind!r}; only \"function\" tools are supported")
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}]: a function tool needs a function with a non-empty name")
        if name in out:
            raise RequestError(f"tools[{i}]: duplicate tool name {name!r}; tool names must be unique")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict | bool):
            raise RequestError(f"tools[{i}] ({name}): parameters must be a JSON schema object")
        out[name] = params
    return out


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    """(mode, name): ("none" | "auto" | "required", None), or ("named", one of names)."""
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"unknown tool_choice {tool_choice!r}; use none, auto, required "
                               'or {"type": "function", "function": {"name": ...}}')
        if tool_choice == "required" and not names:
            raise RequestError('tool_choice "required" needs tools, and none were given')
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if not names:
        raise RequestError(f"tool_choice names the function {name!r}, but no tools were given")
    if name not in names:
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                           f"({', '.join(names)})")
    return "named", name


def _calls(m: _Markup | _Tagged, functions: dict[str, dict | bool], many: bool) -> dict:
    """The tag matching a block of calls: one call, or one or more when many."""
    if isinstance(m, _Tagged):
        style = {"style": m.style, "max_whitespace_cnt": XML_WHITESPACE} if m.style != "json" else {}
        tags = [{"type": "tag", "begin": m.call_head + name + m.call_mid,
                 "content": {"type": "json_schema", "json_schema": params, **style}, "end": m.call_end}
                for name, params in functions.items()]
        begin, sep, end = m.open, m.sep, m.close
    else:
        tags = [{"type": "tag", "begin": f"{json.dumps(name, ensure_ascii=False)}, \"{m.key}\": ",
                 "content": {"type": "json_schema", "json_schema": params}, "end": ""}
                for name, params in functions.items()]
        begin, sep, end = m.open + _HEAD, "}" + m.sep + _HEAD, "}" + m.close
    return {"type": "tag", "begin": begin,
            "content": {"type": "tags_with_separator", "tags": tags, "separator": sep,
                        "at_least_one": True, "stop_after_first": not many},
            "end": end}


def _bare_names(functions: dict[str, dict | bool], fmt: str, forbidden: str) -> None:
    """RequestError for a name that markup writing it bare could not delimit."""
    for i, name in enumerate(functions):
        if any(c.isspace() or c in forbidden for c in name):
            raise RequestError(f"tools[{i}]: the name {name!r} cannot be written in {fmt}'s tool-call markup "
                               f"(no whitespace or {' '.join(repr(c) for c in forbidden)} in a name there)")


def _spec(fmt: dict) -> GrammarSpec:
    tag = {"type": "structural_tag", "format": fmt}
    return GrammarSpec("structural_tag", json.dumps(tag, ensure_ascii=False, separators=(",", ":")))


def tool_call_grammar(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool,
                      fmt: str) -> GrammarSpec | None:
    """The grammar of a reply under tool_choice, in the markup of fmt (the module docstring
    says what each choice allows); None where nothing is constrained. The tools, fmt and
    tool_choice are checked whatever the choice: RequestError for what is not valid."""
    if fmt == UNCONSTRAINED:
        mode, _ = _choice(tool_choice, list(_functions(tools)))
        if mode in ("none", "auto"):
            return None
        raise RequestError(f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'naming a function'} "
                           "is not supported with gpt-oss's harmony tool calls (--tool-call-parser openai): "
                           'use "auto" or "none"')
    m: _Markup | _Tagged | None = _MARKUP.get(fmt) or _TAGGED.get(fmt)
    if m is None:
        raise RequestError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")
    functions = _functions(tools)
    if isinstance(m, _Tagged):
        _bare_names(functions, fmt, m.forbidden)
    mode, name = _choice(tool_choice, list(functions))
    if mode == "none" or (mode == "auto" and not functions):
        return None
    if mode == "auto":
        block = _calls(m, functions, parallel_tool_calls)
        return _spec({"type": "triggered_tags", "triggers": [m.trigger], "tags": [block],
                      "stop_after_first": True})
    if mode == "required":
        return _spec(_calls(m, functions, parallel_tool_calls))
    assert name is not None
    return _spec(_calls(m, {name: functions[name]}, many=False))


def after_reasoning(spec: GrammarSpec, end: str = "</think>", start: str | None = "<think>") -> GrammarSpec:
    """spec's language after a reasoning block: free text up to and including the first
    `end`, optional whitespace, then a sentence of spec (any kind).

    start given: the output may open with it (a model that writes its own "<think>") or
    not (a chat template that already did), and the reasoning contains it nowhere else.
    start None: the output is inside the reasoning from its first token. The reasoning
    cannot contain `end` itself: its first `end` is where it stops. RequestError if spec's
    value is malformed (the rest shows when the result is compiled); ValueError for an
    empty end (a server setting, not a request's)."""
    if not end:
        raise ValueError("after_reasoning needs a non-empty end tag")
    text: dict = {"type": "any_text"}
    elements: list[dict] = []
    if start:
        text["excludes"] = [start]
        elements.append({"type": "optional", "content": {"type": "const_string", "value": start}})
    elements += [{"type": "tag", "begin": "", "content": text, "end": end}, _WHITESPACE,
                 format_of(spec.kind, spec.value)]
    return _spec({"type": "sequence", "elements": elements})
