"""Tool-call parsing (server/tool_parsers.py): what each format's output parses into, and
that streaming it in any splitting emits exactly that, without markup in the content."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.server.tool_parsers import PARSERS, ToolCall, ToolCallDelta, collect_calls, parser_for

MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<function=",
          "<parameter=", "</parameter>", "</function>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
GENERATED_ID = {
    "hermes": re.compile(r"call_[0-9a-f]{24}"),
    "llama3_json": re.compile(r"call_[0-9a-f]{24}"),
    "mistral": re.compile(r"[A-Za-z0-9]{9}"),
    "qwen3_coder": re.compile(r"call_[0-9a-f]{24}"),
    "glm45": re.compile(r"call_[0-9a-f]{24}"),
}
NESTED = {
    "q": 'Zürich — 東京 "quoted" {braces} [brackets] \\ back',
    "filter": {"a": [1, {"b": None}], "c": "}", "d": "</tool_call>]"},
}


@dataclass
class Case:
    parser: str
    name: str
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    ids: list[str] | None = None  # the model's own ids, where the format carries them
    markup_free: bool = True  # the content contains no markup, so none may ever be emitted

    def __str__(self) -> str:
        return f"{self.parser}-{self.name}"


def hermes(name: str, args: dict[str, Any], **dumps: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, **dumps) + "\n</tool_call>"


def llama(name: str, args: dict[str, Any], key: str = "parameters") -> str:
    return json.dumps({"name": name, key: args})


def xml(name: str, args: dict[str, str]) -> str:
    """A call as Qwen3-Coder's template writes it (values as text: the parser unbound to
    any tools reads every value as text)."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm(name: str, args: dict[str, str]) -> str:
    """A call as GLM-4.5's template writes it (values as text)."""
    params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{params}</tool_call>"


PARIS = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"tz": "UTC", "format": 24})

CASES = [
    # hermes
    Case("hermes", "one call", hermes(*PARIS), "", [PARIS]),
    Case("hermes", "two parallel calls", hermes(*PARIS) + "\n" + hermes(*TIME), "", [PARIS, TIME]),
    Case("hermes", "content before", "Let me check.\n\n" + hermes(*PARIS), "Let me check.", [PARIS]),
    Case("hermes", "content after", "Hi\n" + hermes(*PARIS) + "\nDone.", "Hi\n\nDone.", [PARIS]),
    Case("hermes", "unicode nested", hermes("search", NESTED, ensure_ascii=False), "", [("search", NESTED)]),
    Case("hermes", "escaped unicode", hermes("search", NESTED, ensure_ascii=True), "", [("search", NESTED)]),
    Case("hermes", "compact", '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>', "", [("f", {"x": 1})]),
    Case("hermes", "spacious", '<tool_call>\n  {\n "name" : "f" ,\n "arguments" : { } }\n\n</tool_call>\n', "",
         [("f", {})]),
    Case("hermes", "no arguments", '<tool_call>\n{"name": "f"}\n</tool_call>', "", [("f", {})]),
    Case("hermes", "string arguments", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
         [("f", {"a": 1})]),
    Case("hermes", "no close tag", '<tool_call>\n{"name": "f", "arguments": {}}\n', "", [("f", {})]),
    Case("hermes", "cut close tag", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_', "", [("f", {})]),
    Case("hermes", "no call", "The weather in Paris is sunny.", "The weather in Paris is sunny."),
    Case("hermes", "surrounding whitespace", "\n  Sunny.  \n", "Sunny."),
    Case("hermes", "looks like markup", "a < b, <tool> and <tool_c are tags", "a < b, <tool> and <tool_c are tags"),
    Case("hermes", "tag without json", "Write <tool_call> to call.", "Write <tool_call> to call.", markup_free=False),
    Case("hermes", "bad json", '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>', markup_free=False),
    Case("hermes", "no name", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
         markup_free=False),
    Case("hermes", "unclosed json", 'Hm <tool_call>\n{"name": "f", "argu', 'Hm <tool_call>\n{"name": "f", "argu',
         markup_free=False),
    Case("hermes", "bad then good", '<tool_call>{"x": 1}</tool_call>\n' + hermes(*PARIS),
         '<tool_call>{"x": 1}</tool_call>', [PARIS], markup_free=False),
    # llama3_json
    Case("llama3_json", "one call", llama(*PARIS), "", [PARIS]),
    Case("llama3_json", "python tag", "<|python_tag|>" + llama(*PARIS), "", [PARIS]),
    Case("llama3_json", "arguments key", llama(*PARIS, key="arguments"), "", [PARIS]),
    Case("llama3_json", "two parallel calls", llama(*PARIS) + "; " + llama(*TIME), "", [PARIS, TIME]),
    Case("llama3_json", "leading whitespace", "\n\n " + llama(*PARIS) + "\n", "", [PARIS]),
    Case("llama3_json", "unicode nested", json.dumps({"name": "s", "parameters": NESTED}, ensure_ascii=False), "",
         [("s", NESTED)]),
    Case("llama3_json", "no call", "The answer is 42.", "The answer is 42."),
    Case("llama3_json", "not a call object", '{"answer": 42}', '{"answer": 42}'),
    Case("llama3_json", "looks like the tag", "<|python is a snake|>", "<|python is a snake|>"),
    Case("llama3_json", "incomplete json", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}'),
    Case("llama3_json", "call then text", llama(*PARIS) + "; oops", "; oops", [PARIS]),
    Case("llama3_json", "call then bad call", llama(*PARIS) + '; {"x": 1}', '; {"x": 1}', [PARIS]),
    # mistral
    Case("mistral", "one call with id",
         '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]', "", [PARIS],
         ids=["abcDEF123"]),
    Case("mistral", "two calls without ids",
         "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in (PARIS, TIME)]), "", [PARIS, TIME]),
    Case("mistral", "content before", "Sure.\n[TOOL_CALLS] " + json.dumps([{"name": "f", "arguments": {}}]),
         "Sure.", [("f", {})]),
    Case("mistral", "id of the wrong shape", '[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "x"}]', "",
         [("f", {})]),
    Case("mistral", "unicode nested", "[TOOL_CALLS]" + json.dumps([{"name": "s", "arguments": NESTED}]), "",
         [("s", NESTED)]),
    Case("mistral", "name form", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [PARIS]),
    Case("mistral", "name form, two calls", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
         '[ARGS]{"tz": "UTC", "format": 24}', "", [PARIS, TIME]),
    Case("mistral", "name form with id", "[TOOL_CALLS]f[CALL_ID]abcDEF123[ARGS]{}", "", [("f", {})],
         ids=["abcDEF123"]),
    Case("mistral", "name form nested", "[TOOL_CALLS]s[ARGS]" + json.dumps(NESTED, ensure_ascii=False), "",
         [("s", NESTED)]),
    Case("mistral", "no call", "No tools needed.", "No tools needed."),
    Case("mistral", "looks like markup", "[TOOL_C is not [TOOL] it", "[TOOL_C is not [TOOL] it"),
    Case("mistral", "tag in prose", "[TOOL_CALLS] is the tag.", "[TOOL_CALLS] is the tag.", markup_free=False),
    Case("mistral", "bad json", '[TOOL_CALLS][{"name": "f", "arguments": {"a": ]}]',
         '[TOOL_CALLS][{"name": "f", "arguments": {"a": ]}]', markup_free=False),
    Case("mistral", "no name", '[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]',
         markup_free=False),
    Case("mistral", "unclosed", '[TOOL_CALLS]f[ARGS]{"a": 1', '[TOOL_CALLS]f[ARGS]{"a": 1', markup_free=False),
    # qwen3_coder
    Case("qwen3_coder", "one call", xml(*PARIS), "", [PARIS]),
    Case("qwen3_coder", "two parallel calls", xml(*PARIS) + "\n" + xml("get_time", {"tz": "UTC"}), "",
         [PARIS, ("get_time", {"tz": "UTC"})]),
    Case("qwen3_coder", "content before", "Let me check.\n\n" + xml(*PARIS), "Let me check.", [PARIS]),
    Case("qwen3_coder", "code keeps its lines", xml("write", {"code": "def f():\n    return '<b>'\n"}), "",
         [("write", {"code": "def f():\n    return '<b>'\n"})]),
    Case("qwen3_coder", "no arguments", "<tool_call>\n<function=now>\n</function>\n</tool_call>", "", [("now", {})]),
    Case("qwen3_coder", "compact", "<tool_call><function=f><parameter=a>1</parameter></function></tool_call>", "",
         [("f", {"a": "1"})]),
    Case("qwen3_coder", "no close tag", "<tool_call>\n<function=f>\n</function>\n", "", [("f", {})]),
    Case("qwen3_coder", "unclosed parameter", "<tool_call>\n<function=f>\n<parameter=a>\n1",
         "<tool_call>\n<function=f>\n<parameter=a>\n1", markup_free=False),
    Case("qwen3_coder", "tag without function", "Write <tool_call> to call.", "Write <tool_call> to call.",
         markup_free=False),
    Case("qwen3_coder", "empty name", "<tool_call>\n<function=>\n</function>\n</tool_call>",
         "<tool_call>\n<function=>\n</function>\n</tool_call>", markup_free=False),
    Case("qwen3_coder", "hermes json is not this format", hermes(*PARIS), hermes(*PARIS), markup_free=False),
    # glm45
    Case("glm45", "one call", glm(*PARIS), "", [PARIS]),
    Case("glm45", "two parallel calls", glm(*PARIS) + "\n" + glm("get_time", {"tz": "UTC"}), "",
         [PARIS, ("get_time", {"tz": "UTC"})]),
    Case("glm45", "content before", "Let me check.\n" + glm(*PARIS), "Let me check.", [PARIS]),
    Case("glm45", "compact", "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", "",
         [("f", {"a": "1"})]),
    Case("glm45", "no arguments", "<tool_call>now\n</tool_call>", "", [("now", {})]),
    Case("glm45", "multi-line value", glm("write", {"code": "a\n  b <c>"}), "", [("write", {"code": "a\n  b <c>"})]),
    Case("glm45", "no close tag", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n", "",
         [("f", {"a": "1"})]),
    Case("glm45", "unclosed value", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1",
         "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1", markup_free=False),
    Case("glm45", "hermes json is not this format", hermes(*PARIS), hermes(*PARIS), markup_free=False),
    Case("glm45", "no call", "Sunny <b>today</b>.", "Sunny <b>today</b>."),
]


def streamed(parser: str, pieces: list[str]) -> tuple[list[str], list[ToolCallDelta]]:
    """The content fragments and the deltas that streaming `pieces` emits."""
    s = PARSERS[parser].stream()
    fragments, deltas = [], []
    for piece in pieces:
        content, ds = s.feed(piece)
        fragments.append(content)
        deltas += ds
    content, ds = s.finish()
    return [*fragments, content], deltas + ds


def assert_same_calls(case: Case, got: list[ToolCall], want: list[ToolCall]) -> None:
    assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in want]
    for g, w in zip(got, want):
        if w.id in case.text:  # the model's own id
            assert g.id == w.id
        else:
            assert GENERATED_ID[case.parser].fullmatch(g.id), g.id


def assert_streams_like_parse(case: Case, pieces: list[str]) -> None:
    assert "".join(pieces) == case.text
    content, calls = PARSERS[case.parser].parse(case.text)
    fragments, deltas = streamed(case.parser, pieces)
    assert "".join(fragments) == content
    assert_same_calls(case, collect_calls(deltas), calls)
    first = {}
    for d in deltas:  # id and name exactly once, in a call's first delta, with no arguments yet
        if d.index not in first:
            first[d.index] = d
            assert d.id and d.name and d.arguments == ""
        else:
            assert d.id is None and d.name is None
    assert sorted(first) == list(range(len(calls)))
    if case.markup_free:
        assert not any(tag in f for f in fragments for tag in MARKUP)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parse_gives_the_content_and_the_calls(case):
    content, calls = PARSERS[case.parser].parse(case.text)
    assert content == case.content
    assert [(c.name, c.arguments) for c in calls] == [(n, json.dumps(a, ensure_ascii=False)) for n, a in case.calls]
    for i, call in enumerate(calls):
        if case.ids:
            assert call.id == case.ids[i]
        else:
            assert GENERATED_ID[case.parser].fullmatch(call.id), call.id


@pytest.mark.parametrize("case", CASES, ids=str)
def test_streaming_character_by_character_equals_parse(case):
    assert_streams_like_parse(case, list(case.text))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_streaming_in_two_pieces_at_every_point_equals_parse(case):
    for cut in range(len(case.text) + 1):
        assert_streams_like_parse(case, split_at(case.text, [cut]))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_streaming_at_random_boundaries_equals_parse(case):
    rng = random.Random(str(case))
    for _ in range(50):
        cuts = rng.sample(range(len(case.text) + 1), rng.randint(1, min(12, len(case.text))))
        assert_streams_like_parse(case, split_at(case.text, cuts))


FRAGMENTS = [*MARKUP, "<tool", "[TOOL_C", "<|python", "</tool_", '{"name": "f", ', '"arguments": {"a": "}"}}',
             '"parameters": {}}', "{", "}", "[", "]", '"', "\\", "; ", "\n", " ", "hi", "f", ",", "[{", "f>", "a>",
             "<function=f>", "<parameter=a>", "</para", "<", "<arg_key>a</arg_key>", "<arg_value>", "</arg_"]


@pytest.mark.parametrize("parser", PARSERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_text_streams_like_parse_in_any_splitting(parser, data):
    """Also for arbitrary mixes of markup pieces: nothing is lost or duplicated."""
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=20)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    case = Case(parser, "fuzz", text, "", markup_free=False)
    assert_streams_like_parse(case, split_at(text, cuts))


def test_content_streams_as_it_arrives_holding_only_a_possible_tag_and_trailing_whitespace():
    s = PARSERS["hermes"].stream()
    assert s.feed("Hello wor") == ("Hello wor", [])
    assert s.feed("ld <tool") == ("ld", [])
    assert s.feed("s> are") == (" <tools> are", [])
    assert s.feed(" fine\n") == (" fine", [])
    assert s.finish() == ("", [])


@pytest.mark.parametrize(
    "parser, head, tail",
    [
        ("hermes", 'Ok.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', ""),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', '; {"name": "g"'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "[TOOL_CALLS]g"),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}', "[TOOL_CALLS]g"),
    ],
)
def test_a_call_goes_out_as_soon_as_its_markup_completes(parser, head, tail):
    s = PARSERS[parser].stream()
    _, deltas = s.feed(head)
    assert collect_calls(deltas)[0].name == "f"
    assert collect_calls(deltas)[0].arguments == '{"a": 1}'
    assert s.feed(tail) == ("", [])


def test_each_stream_numbers_its_calls_from_zero():
    text = hermes(*PARIS) + hermes(*TIME)
    for _ in range(2):
        _, deltas = streamed("hermes", [text])
        assert [d.index for d in deltas] == [0, 0, 1, 1]


def test_qwen3_coder_values_are_typed_by_the_tools_schemas():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "on": {"type": "boolean"}, "tags": {"type": "array"},
        "opts": {"type": "object"}, "id": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "k": {"enum": [1, 2]},
        "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "bad": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    text = xml("f", {"n": "24", "x": "2.5", "on": "true", "tags": '["a", 1]', "opts": '{"a": {"b": null}}',
                     "id": "007", "unit": "c", "k": "2", "maybe": "null", "bad": "twelve", "extra": "42"})
    want = {"n": 24, "x": 2.5, "on": True, "tags": ["a", 1], "opts": {"a": {"b": None}}, "id": "007", "unit": "c",
            "k": 2, "maybe": None, "bad": "twelve", "extra": "42"}  # (unknown to the schema, or not JSON: text)
    content, calls = PARSERS["qwen3_coder"].with_schemas(tools).parse(text)
    assert content == "" and json.loads(calls[0].arguments) == want
    glm_text = glm("f", {"n": "24", "x": "2.5", "on": "true", "tags": '["a", 1]', "opts": '{"a": {"b": null}}',
                         "id": "007", "unit": "c", "k": "2", "maybe": "null", "bad": "twelve", "extra": "42"})
    content, calls = PARSERS["glm45"].with_schemas(tools).parse(glm_text)
    assert content == "" and json.loads(calls[0].arguments) == want
    # the parsers without schemas are the shared ones, unchanged
    assert PARSERS["qwen3_coder"].schemas is None and PARSERS["hermes"].with_schemas(tools) is PARSERS["hermes"]


def test_the_delta_encodes_without_its_defaults():
    import msgspec

    assert msgspec.json.encode(ToolCallDelta(0, arguments='{"a"')) == b'{"index":0,"arguments":"{\\"a\\""}'


# ---- parser_for ----------------------------------------------------------------------

QWEN = "{%- if tools %}...<tools></tools>...<tool_call>\\n{\"name\": <function-name>, ...}\\n</tool_call>"
MISTRAL = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool_call in message.tool_calls %}"
LLAMA31 = "{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}"
LLAMA32 = '{{- \'{"name": "function name", "parameters": dictionary}\' }}{%- elif message.role == "ipython" %}'
GLM45 = "{{ '<tool_call>' + tc.name }}{% for k, v in args.items() %}<arg_key>{{ k }}</arg_key>{% endfor %}"
QWEN3_CODER = ("<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
               "</parameter>\\n</function>\\n</tool_call>")


@pytest.mark.parametrize("template, name", [(QWEN, "hermes"), (MISTRAL, "mistral"), (LLAMA31, "llama3_json"),
                                            (LLAMA32, "llama3_json"), (QWEN3_CODER, "qwen3_coder"), (GLM45, "glm45")])
def test_auto_picks_the_format_the_chat_template_writes(template, name):
    assert parser_for("auto", template).name == name


def test_a_named_parser_ignores_the_template():
    assert parser_for("mistral", QWEN) is PARSERS["mistral"]


@pytest.mark.parametrize("name, template", [("nope", QWEN), ("auto", None), ("auto", "{{ messages }}")])
def test_an_unknown_name_or_an_unrecognized_template_names_the_choices(name, template):
    with pytest.raises(ValueError, match="auto, hermes, llama3_json, mistral"):
        parser_for(name, template)


# ---- the markers as special tokens, through the chat API ------------------------------------

MARKS = {"mistral": ("[TOOL_CALLS]", "[ARGS]"), "llama3_json": ("<|python_tag|>",),
         "hermes": ("<tool_call>", "</tool_call>")}
"""Each format's tags as special tokens, as the real tokenizers have them (whatever the parser declares)."""
MARKER_OUTPUTS = {
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "{{ '[TOOL_CALLS]' }}"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "{{ '<|python_tag|>' }}"),
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               "{{ '<tool_call>' }}{% for t in tools %}{% endfor %}"),
}


@pytest.mark.parametrize("fmt", sorted(MARKER_OUTPUTS))
def test_a_format_whose_markers_are_special_tokens_still_parses(fmt, default_model):
    """Mistral's [TOOL_CALLS] / [ARGS] and Llama 3's <|python_tag|> are special tokens of
    their tokenizers (as hermes' tags are of some): skip_special_tokens would drop them
    before the parser saw them, unless the server keeps its parser's markers."""
    from starlette.testclient import TestClient

    from streamer.config import ServerConfig
    from streamer.server.app import create_app
    from tests.server.fakes import Detokenizing, marker_tokenizer

    text, template = MARKER_OUTPUTS[fmt]
    tok = marker_tokenizer(default_model, MARKS[fmt],
                           "{% for m in messages %}{{ m.content }}{% endfor %}" + template)
    engine = Detokenizing(tok, text)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    config = ServerConfig(allowed_hosts=("testserver",), tool_call_parser=fmt)
    with TestClient(create_app(engine, config)) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Paris?"}],
                                                      "tools": tools})
    assert r.status_code == 200, r.text
    assert set(PARSERS[fmt].markers) <= set(engine.sent[-1].params.keep_special_tokens)
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})


def test_a_qwen3_coder_template_gets_its_xml_calls_and_grammar():
    """A template that renders tools and writes <function=...> calls: "auto" picks qwen3_coder,
    whose parser types values by the request's tools, and the grammar writes XML arguments."""
    import types

    from streamer.server.chat_output import ChatSetup

    template = "{% for t in tools %}{{ t }}{% endfor %}" + QWEN3_CODER
    tools = [{"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}}}]
    setup = ChatSetup.of(tools=tools, tool_choice="required", parallel=False, grammar=None, template_kwargs={},
                         hf_tokenizer=types.SimpleNamespace(chat_template=template), tool_parser="auto",
                         reasoning_parser=None)
    assert setup.tools is not None and setup.tools.name == "qwen3_coder"
    assert setup.grammar is not None and '"style":"qwen_xml"' in setup.grammar.value
    parsed = setup.output().parse(xml("set_alarm", {"hour": "7"}))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("set_alarm", {"hour": 7})]
