"""tool_call_grammar and after_reasoning, compiled with the engine's GrammarCompiler on the
default model's tokenizer (no model): which replies each grammar accepts, and that what
a random walk through it writes is a well-formed call with valid arguments."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from streamer.chat_template import DEEPSEEK_MARKERS
from streamer.errors import RequestError
from streamer.messages import GrammarSpec
from streamer.sampling.grammar import GrammarState, fill_bitmask
from streamer.sampling.grammar_compiler import GrammarCompiler
from streamer.server.tool_grammar import FORMATS, after_reasoning, tool_call_grammar
from streamer.server.tool_parsers import PARSERS

VOCAB = 49152  # SmolLM2's model vocabulary

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
}, "required": ["city"]}
ALARM = {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    "days": {"type": "array", "items": {"enum": ["mon", "tue", "sat"]}, "maxItems": 3},
    "loud": {"type": "boolean"},
}, "required": ["hour", "loud"]}


def function(name: str, parameters: dict | None = None) -> dict:
    fn: dict[str, Any] = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


TOOLS = [function("get_weather", WEATHER), function("set_alarm", ALARM)]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
NAMED = {"type": "function", "function": {"name": "set_alarm"}}


# ---- the markup, as the brief gives it (what the tool-call parser expects) ---------------

Call = tuple[str, dict[str, Any]]
"""(tool name, arguments)"""
KEY = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}
CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP = DEEPSEEK_MARKERS
TRIGGER = {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]",
           "deepseek_v3": CALLS_BEGIN, "deepseek_v31": CALLS_BEGIN, "qwen3_coder": "<tool_call>\n",
           "glm45": "<tool_call>"}
XML = ("qwen3_coder", "glm45")
"""The formats whose arguments are XML with raw values (their parsers type them by the schemas)."""
"""Where "auto" text gives way to a call."""
DEEPSEEK_CALL = {  # (the head before a call's name, what comes between it and the JSON, the call's end)
    "deepseek_v3": (CALL_BEGIN + "function" + SEP, "\n```json\n", "\n```" + CALL_END, "\n"),
    "deepseek_v31": (CALL_BEGIN, SEP, CALL_END, ""),
}
"""DeepSeek's calls: head NAME mid ARGS end, joined by the last, in CALLS_BEGIN ... CALLS_END."""


def xml_call(name: str, args: dict[str, Any]) -> str:
    """A call as Qwen3-Coder's template writes it: each value raw, a string as it is."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm_call(name: str, args: dict[str, Any]) -> str:
    """A call as GLM-4.5's template writes it."""
    params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                     for k, v in args.items())
    return f"<tool_call>{name}\n{params}</tool_call>"


def render(fmt: str, calls: list[Call]) -> str:
    if fmt in XML:
        return "\n".join((xml_call if fmt == "qwen3_coder" else glm_call)(name, args) for name, args in calls)
    if fmt in DEEPSEEK_CALL:
        head, mid, end, sep = DEEPSEEK_CALL[fmt]
        return CALLS_BEGIN + sep.join(head + name + mid + json.dumps(args, ensure_ascii=False) + end
                                      for name, args in calls) + CALLS_END
    objs = [json.dumps({"name": name, KEY[fmt]: args}) for name, args in calls]
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if fmt == "llama3_json":
        return "; ".join(objs)
    return "[TOOL_CALLS][" + ", ".join(objs) + "]"


def parse(fmt: str, text: str) -> list[Call]:
    """The calls in text, which must be exactly the markup of fmt (AssertionError if not)."""
    if fmt in XML:  # (the parser, typing the values by the tools' schemas)
        content, calls = PARSERS[fmt].with_schemas(TOOLS).parse(text)
        assert content == "", text
        return [(c.name, json.loads(c.arguments)) for c in calls]
    if fmt in DEEPSEEK_CALL:
        return parse_deepseek(fmt, text)
    open_, sep, close = {"hermes": ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
                         "llama3_json": ("", "; ", ""), "mistral": ("[TOOL_CALLS][", ", ", "]")}[fmt]
    assert text.startswith(open_), text
    decoder, pos, calls = json.JSONDecoder(), len(open_), []
    while True:
        obj, pos = decoder.raw_decode(text, pos)
        assert list(obj) == ["name", KEY[fmt]], text
        calls.append((obj["name"], obj[KEY[fmt]]))
        if not text.startswith(sep, pos):
            assert text[pos:] == close, text
            return calls
        pos += len(sep)


def parse_deepseek(fmt: str, text: str) -> list[Call]:
    head, mid, end, sep = DEEPSEEK_CALL[fmt]
    name = re.compile(re.escape(head) + r"([^\s｜]+)" + re.escape(mid))
    decoder, pos, calls = json.JSONDecoder(), len(CALLS_BEGIN), []
    assert text.startswith(CALLS_BEGIN), text
    while True:
        m = name.match(text, pos)
        assert m, text
        args, pos = decoder.raw_decode(text, m.end())
        assert isinstance(args, dict) and text.startswith(end, pos), text
        calls.append((m.group(1), args))
        pos += len(end)
        if not text.startswith(sep + head, pos):
            assert text[pos:] == CALLS_END, text
            return calls
        pos += len(sep)


def valid(calls: list[Call]) -> None:
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])


WEATHER_CALL: Call = ("get_weather", {"city": "Paris", "unit": "celsius"})
ALARM_CALL: Call = ("set_alarm", {"hour": 7, "days": ["mon", "tue"], "loud": False})
BAD_CALLS: dict[str, Call] = {
    "an unknown name": ("get_time", {}),
    "a missing required argument": ("get_weather", {"unit": "celsius"}),
    "an argument of the wrong type": ("set_alarm", {"hour": "seven", "loud": False}),
    "an argument out of range": ("set_alarm", {"hour": 24, "loud": False}),
    "a value not in the enum": ("get_weather", {"city": "Paris", "unit": "kelvin"}),
    "an argument the schema lacks": ("get_weather", {"city": "Paris", "when": "now"}),
}


# ---- driving a grammar -----------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(default_model):
    from transformers import AutoTokenizer

    gc = GrammarCompiler(AutoTokenizer.from_pretrained(str(default_model)), VOCAB)
    yield gc
    gc.close()


def accepts(compiler: GrammarCompiler, spec: GrammarSpec | None, text: str) -> bool:
    """text is a whole reply of spec: accepted, then the stop token ends it."""
    assert spec is not None
    s = compiler.state_for(spec)
    return bool(s.matcher.accept_string(text)) and s.is_completed() and s.accept(compiler.info.stop_token_ids[0])


def random_walk(compiler: GrammarCompiler, s: GrammarState, g: torch.Generator, limit: int = 300,
                blank_ok: bool = True) -> str | None:
    """Random allowed tokens until the grammar terminates (the text written) or `limit` (None).
    blank_ok False: a token of whitespace alone (but one newline) only where nothing else is
    allowed (a grammar that allows whitespace anywhere would spend the walk on it, as no model
    does)."""
    decoded = compiler.info.decoded_vocab
    out = bytearray()
    for _ in range(limit):
        mask = fill_bitmask([s], VOCAB)
        ok = ((mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero().flatten()
        if not blank_ok:
            inked = ok[[bool(decoded[int(t)].strip()) or decoded[int(t)] == b"\n" for t in ok]]
            ok = inked if len(inked) else ok
        t = int(ok[torch.randint(len(ok), (1,), generator=g)])
        assert s.accept(t)
        if s.is_terminated():
            return out.decode()
        out += decoded[t]
    return None


# ---- what each tool_choice accepts -----------------------------------------------------


@pytest.mark.parametrize("fmt", XML)
def test_xml_markup_takes_little_whitespace_and_string_values_any(compiler, fmt):
    """tool_grammar.XML_WHITESPACE: a run of whitespace between parameters or before a number is
    refused; a string value's own (indented code) is not."""
    spec = tool_call_grammar(TOOLS, "required", False, fmt)
    call = render(fmt, [ALARM_CALL])
    assert accepts(compiler, spec, call)
    number = str(ALARM_CALL[1]["hour"])
    gap = ("</parameter>\n", "</parameter>\n\n\n\n\n") if fmt == "qwen3_coder" else ("</arg_value>\n", "</arg_value>\n\n\n\n\n")
    assert not accepts(compiler, spec, call.replace(gap[0], gap[1], 1))
    opened = "<parameter=hour>\n" if fmt == "qwen3_coder" else "<arg_key>hour</arg_key>\n<arg_value>"
    assert not accepts(compiler, spec, call.replace(opened + number, opened + "      " + number))
    indented = ("get_weather", {"city": "  Nice    x"})
    assert accepts(compiler, spec, render(fmt, [indented])) and parse(fmt, render(fmt, [indented])) == [indented]


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_is_one_call_of_any_tool_and_nothing_else(compiler, fmt):
    spec = tool_call_grammar(TOOLS, "required", False, fmt)
    for call in (WEATHER_CALL, ALARM_CALL):
        text = render(fmt, [call])
        assert accepts(compiler, spec, text), text
        assert parse(fmt, text) == [call]
        valid([call])
    assert not accepts(compiler, spec, "")
    assert not accepts(compiler, spec, "Sure! " + render(fmt, [WEATHER_CALL]))
    assert not accepts(compiler, spec, render(fmt, [WEATHER_CALL]) + " done")
    assert not accepts(compiler, spec, render(fmt, [WEATHER_CALL, ALARM_CALL]))  # (not parallel)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("why", BAD_CALLS)
def test_a_call_outside_the_tools_or_their_schemas_is_refused(compiler, fmt, why):
    for choice in ("required", "auto"):
        spec = tool_call_grammar(TOOLS, choice, True, fmt)
        assert not accepts(compiler, spec, render(fmt, [BAD_CALLS[why]])), (choice, why)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_calls_are_joined_by_the_formats_separator(compiler, fmt):
    spec = tool_call_grammar(TOOLS, "required", True, fmt)
    for calls in ([ALARM_CALL], [WEATHER_CALL, ALARM_CALL], [ALARM_CALL, ALARM_CALL, WEATHER_CALL]):
        text = render(fmt, calls)
        assert accepts(compiler, spec, text), text
        assert parse(fmt, text) == calls
    two = render(fmt, [WEATHER_CALL, ALARM_CALL])
    if fmt == "mistral":  # one array for all calls, not one per call
        wrong = render(fmt, [WEATHER_CALL]) + render(fmt, [ALARM_CALL])
    else:
        wrong = render(fmt, [WEATHER_CALL]) + " " + render(fmt, [ALARM_CALL])
    assert wrong != two and not accepts(compiler, spec, wrong)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_named_choice_is_exactly_one_call_of_that_tool(compiler, fmt, parallel):
    spec = tool_call_grammar(TOOLS, NAMED, parallel, fmt)
    assert accepts(compiler, spec, render(fmt, [ALARM_CALL]))
    assert not accepts(compiler, spec, render(fmt, [WEATHER_CALL]))
    assert not accepts(compiler, spec, render(fmt, [ALARM_CALL, ALARM_CALL]))
    # the markup up to the first argument is forced: jump-forward writes it
    if fmt in XML:  # (whitespace may come before an argument: the markup up to the name is forced)
        forced = compiler.state_for(spec).jump_forward_string()
        assert forced.startswith({"qwen3_coder": "<tool_call>\n<function=set_alarm>", "glm45": "<tool_call>set_alarm"}[fmt])
        return
    head = render(fmt, [("set_alarm", {})]).split("{}")[0]
    assert compiler.state_for(spec).jump_forward_string() == head + '{"hour": '


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_is_free_text_then_optionally_the_calls(compiler, fmt):
    spec = tool_call_grammar(TOOLS, "auto", True, fmt)
    assert accepts(compiler, spec, "")
    assert accepts(compiler, spec, "It is sunny in Paris, {as usual} <b>today</b>; [see above].")
    for calls in ([WEATHER_CALL], [WEATHER_CALL, ALARM_CALL]):
        assert accepts(compiler, spec, "Let me check.\n" + render(fmt, calls))
        assert accepts(compiler, spec, render(fmt, calls))
    # the calls end the reply
    assert not accepts(compiler, spec, "Let me check.\n" + render(fmt, [WEATHER_CALL]) + " Done.")
    # once the trigger is written, the rest is a call (args checked as for "required")
    assert not accepts(compiler, spec, f"I could use {TRIGGER[fmt]} here")


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_without_parallel_calls_allows_one_call(compiler, fmt):
    spec = tool_call_grammar(TOOLS, "auto", False, fmt)
    assert accepts(compiler, spec, "Let me check. " + render(fmt, [ALARM_CALL]))
    assert not accepts(compiler, spec, "Let me check. " + render(fmt, [ALARM_CALL, WEATHER_CALL]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tool_without_parameters_takes_any_object(compiler, fmt):
    spec = tool_call_grammar([function("now")], "required", False, fmt)
    assert accepts(compiler, spec, render(fmt, [("now", {})]))
    assert accepts(compiler, spec, render(fmt, [("now", {"tz": "UTC", "n": [1, 2]})]))
    if fmt not in XML:  # (XML arguments are always an object)
        assert not accepts(compiler, spec, render(fmt, [("now", {})]).replace("{}", "[]"))


def test_names_are_json_strings_in_the_markup(compiler):
    odd = 'say "hi"\\ über'
    spec = tool_call_grammar([function(odd, WEATHER)], "required", False, "hermes")
    text = render("hermes", [(odd, {"city": "Köln"})]).replace(r"\u00fc", "ü").replace(r"\u00f6", "ö")
    assert accepts(compiler, spec, text)
    assert parse("hermes", text) == [(odd, {"city": "Köln"})]


def test_nothing_to_constrain_is_none():
    for fmt in FORMATS:
        assert tool_call_grammar(TOOLS, "none", True, fmt) is None
        assert tool_call_grammar([], "none", True, fmt) is None
        assert tool_call_grammar([], "auto", True, fmt) is None


# ---- requests that cannot be served ----------------------------------------------------

@pytest.mark.parametrize("tools, choice, fmt, needle", [
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, "hermes",
     "tool_choice names the function 'get_time', which is not among the tools (get_weather, set_alarm)"),
    ([], "required", "hermes", 'tool_choice "required" needs tools, and none were given'),
    ([], NAMED, "mistral", "tool_choice names the function 'set_alarm', but no tools were given"),
    ([{"type": "code_interpreter"}], "auto", "hermes", "tools[0]: unsupported tool type 'code_interpreter'"),
    ([{"function": {"name": "f"}}], "auto", "hermes", "tools[0]: unsupported tool type None"),
    (TOOLS, "required", "qwen_xml", "unknown tool-call format 'qwen_xml'; use one of hermes, llama3_json, mistral"),
    (TOOLS + [function("get_weather")], "auto", "hermes", "tools[2]: duplicate tool name 'get_weather'"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", "hermes", "non-empty name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "auto", "hermes",
     "tools[0] (f): parameters must be a JSON schema object"),
    (TOOLS, "sometimes", "hermes", "unknown tool_choice 'sometimes'"),
    (TOOLS, {"type": "function"}, "hermes", 'a named tool_choice is {"type": "function"'),
])
def test_bad_tool_requests_are_request_errors(tools, choice, fmt, needle):
    with pytest.raises(RequestError) as e:
        tool_call_grammar(tools, choice, True, fmt)
    assert needle in str(e.value)


def test_a_bad_parameters_schema_is_refused_when_compiled(compiler):
    spec = tool_call_grammar([function("f", {"type": "strange"})], "required", False, "hermes")
    with pytest.raises(RequestError, match='invalid structural_tag: Unsupported type "strange"'):
        compiler.state_for(spec)


# ---- after_reasoning -------------------------------------------------------------------

REASONING = "<think>\nsome reasoning with { and < signs\n</think>\n\n"
INNER = [  # (spec, a valid output, an invalid one)
    (GrammarSpec("json_object"), '{"a": [1, 2]}', "[1, 2]"),
    (GrammarSpec("json_schema", json.dumps(WEATHER)), '{"city": "Oslo"}', '{"town": "Oslo"}'),
    (GrammarSpec("regex", r"[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    (GrammarSpec("ebnf", 'root ::= "(" [a-z]* ")"'), "(ok)", "(OK)"),
    (GrammarSpec("choice", '["yes", "no"]'), "yes", "maybe"),
    (tool_call_grammar(TOOLS, NAMED, False, "hermes"), render("hermes", [ALARM_CALL]),
     render("hermes", [WEATHER_CALL])),
]


@pytest.mark.parametrize("inner, good, bad", INNER, ids=lambda x: x.kind if isinstance(x, GrammarSpec) else "")
def test_after_reasoning_is_free_reasoning_then_the_inner_language(compiler, inner, good, bad):
    assert inner is not None
    spec = after_reasoning(inner)
    assert accepts(compiler, spec, REASONING + good)
    assert accepts(compiler, spec, "already thinking</think>" + good)  # (the template opened it)
    assert not accepts(compiler, spec, REASONING + bad)
    assert not accepts(compiler, spec, good)  # the reasoning block is not optional
    # the first end tag ends the reasoning; the opening tag does not come back inside it
    assert not accepts(compiler, spec, "<think>a</think> b</think>" + good)
    assert not accepts(compiler, spec, "<think>a<think>b</think>" + good)


def test_after_reasoning_with_other_tags(compiler):
    inner = GrammarSpec("choice", '["yes", "no"]')
    spec = after_reasoning(inner, end="[/THINK]", start=None)
    assert accepts(compiler, spec, "thinking, <think> included [/THINK] yes")
    assert not accepts(compiler, spec, "thinking [/THINK] maybe")
    with pytest.raises(ValueError):
        after_reasoning(inner, end="")
    with pytest.raises(RequestError, match="invalid choice"):
        after_reasoning(GrammarSpec("choice", "[]"))


# ---- random walks: the grammar, not hope ----------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["required", "required-parallel", "named", "auto-after-trigger", "after-reasoning"])
def test_random_walks_write_valid_calls(compiler, fmt, case):
    """Random allowed tokens (seeded, no model) until the grammar ends or 300 tokens: every
    finished walk is exactly the format's markup, of known tools, with valid arguments."""
    parallel = case in ("required-parallel", "auto-after-trigger")
    choices: dict[str, str | dict] = {"required": "required", "required-parallel": "required", "named": NAMED,
                                      "auto-after-trigger": "auto", "after-reasoning": "required"}
    choice = choices[case]
    spec = tool_call_grammar(TOOLS, choice, parallel, fmt)
    assert spec is not None
    prefix = ""
    if case == "auto-after-trigger":  # (random text would not write the trigger in 300 tokens)
        prefix = "Let me check.\n" + TRIGGER[fmt]
    elif case == "after-reasoning":
        spec, prefix = after_reasoning(spec), REASONING
    g = torch.Generator().manual_seed(0)
    finished, counts = 0, set()
    for _ in range(8):
        s = compiler.state_for(spec)
        assert s.matcher.accept_string(prefix)
        text = random_walk(compiler, s, g, limit=500 if fmt in XML else 300, blank_ok=fmt not in XML)
        if text is None:
            continue
        finished += 1
        if case == "auto-after-trigger":
            text = TRIGGER[fmt] + text
        elif case == "after-reasoning":
            text = text.lstrip(" \t\n\r")  # (the optional whitespace after the end tag)
        calls = parse(fmt, text)
        if fmt in XML:
            # the XML styles let any whitespace surround a value, and random tokens write plenty: a
            # string keeps all but the one newline on each side the template writes
            calls = [(name, {k: v.strip() if isinstance(v, str) else v for k, v in args.items()})
                     for name, args in calls]
        valid(calls)
        assert {name for name, _ in calls} <= set(SCHEMAS)
        if case == "named":
            assert [name for name, _ in calls] == ["set_alarm"]
        counts.add(len(calls))
    assert finished >= 6
    assert counts == {1} if not parallel else max(counts) > 1
