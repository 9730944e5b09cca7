"""DeepSeek's tool-call formats, deepseek_v3 and deepseek_v31 (server/tool_parsers_deepseek.py):
what an output parses into, whole and streamed in any splitting; auto-detection from the
template; the tool_choice grammars compiled with xgrammar, and the parser reading what they
write (test_tool_grammar.py runs its every grammar test on these formats too); and the chat
API end to end over a fake engine whose tokenizer has the markers as special tokens."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from streamer.chat_template import DEEPSEEK_MARKERS, markup_format, tool_format
from streamer.config import ServerConfig
from streamer.engine.detokenizer import IncrementalText
from streamer.errors import RequestError
from streamer.server.app import create_app
from streamer.server.chat_output import ChatSetup
from streamer.server.tool_grammar import tool_call_grammar
from streamer.server.tool_parsers import PARSERS, ToolCallDelta, collect_calls, parser_for
from tests.server.fakes import Detokenizing, marker_tokenizer
from tests.server.test_tool_grammar import (
    ALARM_CALL,
    NAMED,
    SCHEMAS,
    TOOLS,
    accepts,
    compiler,  # noqa: F401 - the fixture
    function,
    random_walk,
    render,
    valid,
)

CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP = DEEPSEEK_MARKERS
FORMATS = ("deepseek_v3", "deepseek_v31")
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
Call = tuple[str, dict[str, Any]]


def call_v3(name: str, args: dict[str, Any], kind: str = "function") -> str:
    return f"{CALL_BEGIN}{kind}{SEP}{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```{CALL_END}"


def call_v31(name: str, args: dict[str, Any]) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{json.dumps(args, ensure_ascii=False)}{CALL_END}"


PARIS: Call = ("get_weather", {"city": "Paris"})
TIME: Call = ("get_time", {"tz": "UTC", "format": 24})
NESTED: Call = ("search", {"q": f'Zürich — 東京 "quoted" {{braces}} ``` {CALL_END} {CALLS_END} \\ back',
                           "filter": {"a": [1, {"b": None}], "c": "}"}})


@dataclass
class Case:
    parser: str
    name: str
    text: str
    content: str
    calls: list[Call] = field(default_factory=list)
    markup_free: bool = True  # the content holds no marker, so none may ever be emitted

    def __str__(self) -> str:
        return f"{self.parser}-{self.name}"


def both(name: str, calls: list[Call], before: str = "", after: str = "", content: str = "") -> list[Case]:
    return [Case(fmt, name, before + render(fmt, calls) + after, content, calls) for fmt in FORMATS]


def cut(text: str, at: str) -> str:
    """text up to `at` (the output ends there)."""
    return text[: text.index(at)]


V3_PARIS, V31_PARIS = call_v3(*PARIS), call_v31(*PARIS)
CASES = [
    *both("one call", [PARIS]),
    *both("parallel calls", [PARIS, TIME, PARIS]),
    *both("text before", [PARIS], before="Let me check the weather.\n\n", content="Let me check the weather."),
    *both("text after the block", [TIME], before="Hm. ", after="\nDone.", content="Hm. \nDone."),
    *both("unicode, markers and fences inside strings", [NESTED]),
    *both("no arguments", [("now", {})]),
    Case("deepseek_v3", "calls joined without newline", CALLS_BEGIN + V3_PARIS + call_v3(*TIME) + CALLS_END, "",
         [PARIS, TIME]),
    Case("deepseek_v31", "calls joined by newlines", CALLS_BEGIN + V31_PARIS + "\n" + call_v31(*TIME) + "\n"
         + CALLS_END, "", [PARIS, TIME]),
    Case("deepseek_v3", "any type word, plain fence, spaces",
         f'{CALLS_BEGIN}{CALL_BEGIN} tool {SEP} get_weather \n```\n {{"city": "Paris"}} \n```\n{CALL_END}{CALLS_END}',
         "", [PARIS]),
    Case("deepseek_v3", "no fence", f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n{{"city": "Paris"}}'
         f"{CALL_END}{CALLS_END}", "", [PARIS]),
    Case("deepseek_v31", "compact json", f'{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{"x":1}}{CALL_END}{CALLS_END}', "",
         [("f", {"x": 1})]),
    # the output ends: inside a call's JSON the markup is content; after it, the call counts
    *[Case(fmt, "cut off inside the arguments", "Ok. " + cut(render(fmt, [PARIS]), "aris"),
           "Ok. " + cut(render(fmt, [PARIS]), "aris"), markup_free=False) for fmt in FORMATS],
    *[Case(fmt, "cut off in the header", cut(render(fmt, [PARIS]), "weather"), cut(render(fmt, [PARIS]), "weather"),
           markup_free=False) for fmt in FORMATS],
    *[Case(fmt, "cut off in a marker", render(fmt, [PARIS])[:30], render(fmt, [PARIS])[:30], markup_free=False)
      for fmt in FORMATS],
    *[Case(fmt, "cut off after the json", render(fmt, [PARIS, TIME])[: render(fmt, [PARIS, TIME]).rindex("}") + 1],
           "", [PARIS, TIME]) for fmt in FORMATS],
    *[Case(fmt, "cut off in the closing markers", render(fmt, [PARIS])[:-7], "", [PARIS]) for fmt in FORMATS],
    # malformed: content, verbatim, and what follows is read again
    Case("deepseek_v3", "bad json", f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{"a": }}\n```{CALL_END}'
         f"{CALLS_END}", f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{"a": }}\n```{CALL_END}{CALLS_END}',
         markup_free=False),
    Case("deepseek_v31", "bad json", f'{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{"a": ]}}{CALL_END}{CALLS_END}',
         f'{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{"a": ]}}{CALL_END}{CALLS_END}', markup_free=False),
    Case("deepseek_v31", "arguments not an object", f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}[1]{CALL_END}{CALLS_END}",
         f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}[1]{CALL_END}{CALLS_END}", markup_free=False),
    Case("deepseek_v31", "a name with a space", f"{CALLS_BEGIN}{CALL_BEGIN}get weather{SEP}{{}}{CALL_END}{CALLS_END}",
         f"{CALLS_BEGIN}{CALL_BEGIN}get weather{SEP}{{}}{CALL_END}{CALLS_END}", markup_free=False),
    Case("deepseek_v3", "no name", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}\n```json\n{{}}\n```{CALL_END}{CALLS_END}",
         f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}\n```json\n{{}}\n```{CALL_END}{CALLS_END}", markup_free=False),
    *[Case(fmt, "an empty block", f"x {CALLS_BEGIN}{CALLS_END}", f"x {CALLS_BEGIN}{CALLS_END}", markup_free=False)
      for fmt in FORMATS],
    Case("deepseek_v31", "bad then good", f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}nope{CALL_END}" + render("deepseek_v31",
         [PARIS]), f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}nope{CALL_END}", [PARIS], markup_free=False),
    Case("deepseek_v3", "a good call, then a bad one", CALLS_BEGIN + V3_PARIS + f"\n{CALL_BEGIN}function{SEP}g\n"
         "```json\n{oops}\n```" + CALL_END + CALLS_END,
         f"{CALL_BEGIN}function{SEP}g\n```json\n{{oops}}\n```{CALL_END}{CALLS_END}", [PARIS], markup_free=False),
    Case("deepseek_v3", "the other format's call", render("deepseek_v31", [PARIS]), render("deepseek_v31", [PARIS]),
         markup_free=False),
    *[Case(fmt, "no call", "It is sunny in <b>Paris</b> {as usual} ```json```.",
           "It is sunny in <b>Paris</b> {as usual} ```json```.") for fmt in FORMATS],
    *[Case(fmt, "looks like a marker", "<｜tool is not <｜tool▁calls it", "<｜tool is not <｜tool▁calls it")
      for fmt in FORMATS],
]


def streamed(parser: str, pieces: list[str]) -> tuple[list[str], list[ToolCallDelta]]:
    s = PARSERS[parser].stream()
    fragments, deltas = [], []
    for piece in pieces:
        content, ds = s.feed(piece)
        fragments.append(content)
        deltas += ds
    content, ds = s.finish()
    return [*fragments, content], deltas + ds


def assert_streams_like_parse(case: Case, pieces: list[str]) -> None:
    assert "".join(pieces) == case.text
    content, calls = PARSERS[case.parser].parse(case.text)
    fragments, deltas = streamed(case.parser, pieces)
    assert "".join(fragments) == content
    assert [(c.name, c.arguments) for c in collect_calls(deltas)] == [(c.name, c.arguments) for c in calls]
    first: dict[int, ToolCallDelta] = {}
    for d in deltas:  # id and name exactly once, in a call's first delta, with no arguments yet
        if d.index not in first:
            first[d.index] = d
            assert d.id and CALL_ID.fullmatch(d.id) and d.name and d.arguments == ""
        else:
            assert d.id is None and d.name is None and d.arguments
    assert sorted(first) == list(range(len(calls)))
    assert len({d.id for d in first.values()}) == len(calls)
    if case.markup_free:
        assert not any(m in f for f in fragments for m in DEEPSEEK_MARKERS)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parse_gives_the_content_and_the_calls(case):
    content, calls = PARSERS[case.parser].parse(case.text)
    assert content == case.content
    assert [(c.name, c.arguments) for c in calls] == [(n, json.dumps(a, ensure_ascii=False)) for n, a in case.calls]
    assert all(CALL_ID.fullmatch(c.id) for c in calls)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_streaming_in_any_splitting_equals_parse(case):
    text = case.text
    assert_streams_like_parse(case, list(text))
    for cut in range(len(text) + 1):
        assert_streams_like_parse(case, split_at(text, [cut]))
    rng = random.Random(str(case))
    for _ in range(50):
        cuts = rng.sample(range(len(text) + 1), rng.randint(1, min(12, len(text))))
        assert_streams_like_parse(case, split_at(text, cuts))


FRAGMENTS = [*DEEPSEEK_MARKERS, "<｜tool", "<｜tool▁call", "function", "get_weather", "f", "\n", " ", "```json",
             "```", "`", '{"a": 1}', '{"a": "}"}', "{", "}", '"', "\\", "[1]", "hi", "x y"]


@pytest.mark.parametrize("parser", FORMATS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_mix_of_markup_streams_like_parse(parser, data):
    """Arbitrary fragments in any splitting: nothing lost, duplicated or reordered."""
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=24)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert_streams_like_parse(Case(parser, "fuzz", text, "", markup_free=False), split_at(text, cuts))


@pytest.mark.parametrize("fmt", FORMATS)
def test_content_streams_at_once_and_a_call_goes_out_when_its_markup_completes(fmt):
    s = PARSERS[fmt].stream()
    assert s.feed("Let me check") == ("Let me check", [])
    assert s.feed(". <｜tool") == (".", [])  # (a marker may be on its way)
    head, tail = render(fmt, [PARIS, TIME]).split(CALL_END, 1)
    assert s.feed(head[len("<｜tool"):]) == ("", [])
    content, deltas = s.feed(CALL_END)
    assert content == "" and [(c.name, c.arguments) for c in collect_calls(deltas)] == [
        ("get_weather", '{"city": "Paris"}')]
    content, deltas = s.feed(tail + "\nThat is all.")
    assert content == " \nThat is all." and [d.index for d in deltas] == [1, 1]
    assert s.finish() == ("", [])


# ---- auto-detection -----------------------------------------------------------------------

V3_TEMPLATE = ("{{ bos_token }}{%- if tools %}{{ '## Tools' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
               "{%- endif %}{%- for m in messages %}{%- if m.tool_calls %}{%- for tool in m.tool_calls %}"
               f"{{{{ '{CALLS_BEGIN}{CALL_BEGIN}' + tool['type'] + '{SEP}' + tool['function']['name'] + '\\n' + "
               f"'```json' + '\\n' + (tool['function']['arguments'] | tojson) + '\\n' + '```' + '{CALL_END}' }}}}"
               f"{{%- endfor %}}{{{{ '{CALLS_END}' }}}}{{%- else %}}{{{{ m.content }}}}{{%- endif %}}{{%- endfor %}}")
V31_TEMPLATE = ("{%- if tools is defined and tools is not none %}{{ 'IMPORTANT: ALWAYS adhere to this exact format "
                f"for tool use:\\n{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
                "{{additional_tool_calls}}" f"{CALLS_END}' }}}}{{%- endif %}}{{%- for m in messages %}}"
                f"{{{{ m.content }}}}{{%- if m.tool_calls %}}{{{{ '{CALLS_BEGIN}' }}}}{{%- for tool in m.tool_calls %}}"
                f"{{{{ '{CALL_BEGIN}' + tool['function']['name'] + '{SEP}' + tool['function']['arguments'] + "
                f"'{CALL_END}' }}}}{{%- endfor %}}{{{{ '{CALLS_END}' }}}}{{%- endif %}}{{%- endfor %}}")
NO_TOOLS = {  # (as DeepSeek's own templates: calls in their markup, arguments concatenated, tools never read)
    "deepseek_v3": V3_TEMPLATE.replace("{%- if tools %}", "{%- if false %}").replace("for t in tools", "for t in []")
    .replace("(tool['function']['arguments'] | tojson)", "tool['function']['arguments']"),
    "deepseek_v31": V31_TEMPLATE.replace("tools is defined and tools is not none", "false"),
}


class Tok:
    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize("template, fmt", [(V3_TEMPLATE, "deepseek_v3"), (V31_TEMPLATE, "deepseek_v31")])
def test_auto_picks_the_deepseek_format_the_template_writes(template, fmt):
    assert markup_format(template) == fmt
    assert tool_format(Tok(template)) == fmt
    assert parser_for("auto", template) is PARSERS[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_deepseeks_own_templates_get_the_tools_written_in_their_layout(default_model, fmt):
    """A DeepSeek template that never reads tools: auto still picks its markup, and render
    writes the signatures into the system message, asking for that markup."""
    from streamer.chat_template import render, renders_tools

    template = NO_TOOLS[fmt]
    assert not renders_tools(template) and tool_format(Tok(template)) == fmt
    tok = marker_tokenizer(default_model, DEEPSEEK_MARKERS, template)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    text = tok.decode(render(tok, history, tools=[function("get_weather", SCHEMAS["get_weather"])]))
    system, rest = text.split("Weather?")
    assert "Be brief.\n\n## Tools\n" in system and "### get_weather\nDescription: the get_weather tool" in system
    assert json.dumps(SCHEMAS["get_weather"]) in system
    fmt_line = system[system.index(CALLS_BEGIN):]
    assert ("```json" in fmt_line) == (fmt == "deepseek_v3") and CALLS_END in fmt_line
    assert [(c.name, c.arguments) for c in PARSERS[fmt].parse(rest)[1]] == [("get_weather", '{"city": "Paris"}')]
    assert "<tool_call>" not in text  # (not the hermes rewriting)


def test_the_templates_render_calls_the_parsers_read():
    import jinja2

    # (arguments as each template takes them: V3's dumps a mapping, V3.1's concatenates a string)
    for template, fmt, args in [(V3_TEMPLATE, "deepseek_v3", {"city": "Paris"}),
                                (V31_TEMPLATE, "deepseek_v31", '{"city": "Paris"}')]:
        call = {"type": "function", "function": {"name": "get_weather", "arguments": args}}
        env = jinja2.Environment()
        env.filters["tojson"] = json.dumps  # (as transformers renders templates: plain text, no HTML escapes)
        text = env.from_string(template).render(
            messages=[{"role": "assistant", "content": "", "tool_calls": [call]}], tools=None, bos_token="")
        content, calls = PARSERS[fmt].parse(text)
        assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


# ---- grammars -------------------------------------------------------------------------------


def parse_exact(fmt: str, text: str) -> list[Call]:
    """The calls of a reply that must be exactly the format's markup, nothing around it."""
    content, calls = PARSERS[fmt].parse(text)
    assert content == "" and text.startswith(CALLS_BEGIN) and text.endswith(CALLS_END), text
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_grammar_is_its_own_format_only(compiler, fmt):  # noqa: F811
    """(What each tool_choice accepts is test_tool_grammar.py's, for these formats too.)"""
    other = "deepseek_v31" if fmt == "deepseek_v3" else "deepseek_v3"
    for choice in ("required", NAMED, "auto"):
        spec = tool_call_grammar(TOOLS, choice, True, fmt)
        assert accepts(compiler, spec, render(fmt, [ALARM_CALL]))
        assert not accepts(compiler, spec, render(other, [ALARM_CALL]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_walks_write_calls_the_parser_reads_and_the_schemas_accept(compiler, fmt):  # noqa: F811
    import torch

    g = torch.Generator().manual_seed(0)
    finished = 0
    for choice, parallel in (("required", True), (NAMED, False)):
        spec = tool_call_grammar(TOOLS, choice, parallel, fmt)
        assert spec is not None
        for _ in range(4):
            text = random_walk(compiler, compiler.state_for(spec), g)
            if text is None:
                continue
            finished += 1
            calls = parse_exact(fmt, text)
            assert calls and {n for n, _ in calls} <= set(SCHEMAS)
            valid(calls)
    assert finished >= 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_name_the_markup_cannot_delimit_is_refused(fmt):
    for name in ("get weather", "a\nb", "x｜y"):
        with pytest.raises(RequestError, match="cannot be written"):
            tool_call_grammar([function(name)], "auto", True, fmt)
    assert tool_call_grammar([function("ok.name-1")], "required", False, fmt) is not None


# ---- the server: markers kept, the API end to end -----------------------------------------------


def setup(**kw: Any) -> ChatSetup:
    args: dict[str, Any] = dict(tools=TOOLS, tool_choice=None, parallel=True, grammar=None, template_kwargs={},
                                hf_tokenizer=Tok(V31_TEMPLATE), tool_parser="auto", reasoning_parser=None)
    return ChatSetup.of(**{**args, **kw})


def test_a_deepseek_parser_keeps_its_markers_and_constrains_its_calls():
    s = setup()
    assert s.tools is PARSERS["deepseek_v31"] and s.keep_special == DEEPSEEK_MARKERS
    assert s.grammar is not None and s.grammar.kind == "structural_tag" and CALLS_BEGIN in s.grammar.value
    r = setup(tool_parser="deepseek_v3", tool_choice="required", hf_tokenizer=Tok(""))
    assert r.tools is PARSERS["deepseek_v3"] and r.keep_special == DEEPSEEK_MARKERS
    assert r.grammar is not None and "```json" in r.grammar.value
    assert setup(tool_parser="hermes").keep_special == ("<tool_call>", "</tool_call>")
    assert setup(tools=None).keep_special == ()


DS_TEMPLATE = V31_TEMPLATE
SAMPLE = "I will look it up." + render("deepseek_v31", [PARIS, TIME])
ASK = {"messages": [{"role": "user", "content": "Weather in Paris, and the time?"}],
       "tools": [function("get_weather"), function("get_time")]}


@pytest.fixture(scope="module")
def deepseek_tok(default_model: Path) -> Any:
    return marker_tokenizer(default_model, DEEPSEEK_MARKERS, DS_TEMPLATE)


def test_the_markers_are_special_tokens_kept_only_when_asked(deepseek_tok):
    ids = deepseek_tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert sum(i in deepseek_tok.all_special_ids for i in ids) == 8  # (each marker one token)
    assert "".join(IncrementalText(deepseek_tok, True, DEEPSEEK_MARKERS).push([i]) for i in ids) == SAMPLE
    assert "".join(IncrementalText(deepseek_tok, True).push([i]) for i in ids) == deepseek_tok.decode(
        ids, skip_special_tokens=True)


@pytest.fixture
def deepseek_api(deepseek_tok) -> Iterator[tuple[Detokenizing, TestClient]]:
    engine = Detokenizing(deepseek_tok, SAMPLE)
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        yield engine, client


def test_tool_calls_through_the_chat_api(deepseek_api):
    engine, client = deepseek_api
    r = client.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 200, r.text
    assert engine.sent[-1].params.keep_special_tokens == list(DEEPSEEK_MARKERS)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will look it up."
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [PARIS, TIME]
    assert len({c["id"] for c in calls}) == 2


def test_streamed_tool_calls_through_the_chat_api(deepseek_api):
    _, client = deepseek_api
    content, calls, reasons = [], [], []
    with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                content.append(c["delta"].get("content") or "")
                calls += c["delta"].get("tool_calls") or []
                reasons.append(c.get("finish_reason"))
    assert "".join(content) == "I will look it up."
    assert not any(m in "".join(content) for m in DEEPSEEK_MARKERS)
    named = [c for c in calls if c.get("id")]
    assert [(c["index"], c["function"]["name"]) for c in named] == [(0, "get_weather"), (1, "get_time")]
    for i, (_, args) in enumerate([PARIS, TIME]):
        assert json.loads("".join(c["function"].get("arguments", "") for c in calls if c["index"] == i)) == args
    assert reasons[-1] == "tool_calls"


def test_under_the_grammar_the_markers_are_the_special_tokens_themselves(deepseek_tok):
    """With DeepSeek's tokenizer the grammar's markers can be written as the one special token
    each (the tokens the model learned; xgrammar does not bar added special tokens)."""
    from streamer.sampling.grammar_compiler import GrammarCompiler

    ids = {m: deepseek_tok.convert_tokens_to_ids(m) for m in DEEPSEEK_MARKERS}
    gc = GrammarCompiler(deepseek_tok, len(deepseek_tok))
    try:
        s = gc.state_for(tool_call_grammar(TOOLS, NAMED, False, "deepseek_v31"))
        for token in (ids[CALLS_BEGIN], ids[CALL_BEGIN], *deepseek_tok.encode("set_alarm", add_special_tokens=False),
                      ids[SEP], *deepseek_tok.encode('{"hour": 7, "loud": true}', add_special_tokens=False),
                      ids[CALL_END], ids[CALLS_END]):
            assert s.accept(token), deepseek_tok.decode([token])
        assert s.is_completed()
        s = gc.state_for(tool_call_grammar(TOOLS, "required", False, "deepseek_v31"))
        assert not s.accept(ids[CALL_BEGIN])  # (the block's begin first)
    finally:
        gc.close()


def test_a_history_with_calls_renders_through_either_template(default_model, deepseek_tok):
    """V3's template dumps the arguments (a mapping); V3.1's concatenates them (the client's
    string): render gives each what it takes, and the call comes out as the parser reads it."""
    from streamer.chat_template import render

    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    v3_tok = marker_tokenizer(default_model, DEEPSEEK_MARKERS, V3_TEMPLATE)
    for tok, fmt in ((v3_tok, "deepseek_v3"), (deepseek_tok, "deepseek_v31")):
        text = tok.decode(render(tok, history, tools=ASK["tools"]))
        block = text[text.rindex(CALLS_BEGIN): text.rindex(CALLS_END) + len(CALLS_END)]
        assert [(c.name, c.arguments) for c in PARSERS[fmt].parse(block)[1]] == [("get_weather", '{"city": "Paris"}')]
