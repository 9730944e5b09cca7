"""gpt-oss's harmony format (server/harmony.py): the reasoning parser openai_gptoss and the
tool-call parser openai, whole and streamed in any splitting; the server keeping the
markers in the text (the detokenizer's keep_special_tokens); auto picking openai; and the
chat API end to end over a fake engine that detokenizes with a tokenizer that has them."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from streamer.chat_template import tool_format
from streamer.config import ServerConfig
from streamer.engine.detokenizer import IncrementalText
from streamer.server.app import create_app
from streamer.server.chat_output import ChatSetup
from streamer.server.harmony import HARMONY_MARKERS
from streamer.server.protocol import ApiError
from streamer.server.reasoning import REASONING_PARSERS
from streamer.server.tool_parsers import PARSERS, collect_calls, parser_for
from tests.server.fakes import Detokenizing, marker_tokenizer

GPTOSS = REASONING_PARSERS["openai_gptoss"]
OPENAI = PARSERS["openai"]
A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"
WEATHER = '{"location": "Paris", "unit": "°C"}'
TIME = '{"tz":"UTC"}'


@dataclass
class Case:
    name: str
    text: str
    reasoning: str | None
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)
    markup_free: bool = True  # no marker may reach content (or reasoning) at all

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("final", f"{A}Let me think.{NEXT}{FINAL}The answer is 4.<|return|>", "Let me think.", "The answer is 4."),
    Case("final without its eos", f"{A}Hm.{NEXT}{FINAL}Four.", "Hm.", "Four."),
    Case("call with constrain", f"{A}Need the weather.{NEXT}<|channel|>commentary to=functions.get_weather "
         f"<|constrain|>json<|message|>{WEATHER}<|call|>", "Need the weather.", "", [("get_weather", WEATHER)]),
    Case("call without constrain", f"{A}x{NEXT}<|channel|>commentary to=functions.get_weather json<|message|>"
         f"{WEATHER}<|call|>", "x", "", [("get_weather", WEATHER)]),
    Case("recipient before the channel", f"{A}x{NEXT} to=functions.get_weather<|channel|>commentary json"
         f"<|message|>{WEATHER}<|call|>", "x", "", [("get_weather", WEATHER)]),
    Case("first message is the call", f" to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>"
         f"{TIME}", None, "", [("get_time", TIME)]),
    Case("several calls", f"{A}two{NEXT}<|channel|>commentary to=functions.get_weather<|message|>{WEATHER}<|call|>"
         f"<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{TIME}<|call|>", "two", "",
         [("get_weather", WEATHER), ("get_time", TIME)]),
    Case("preamble, call, final", f"{A}plan{NEXT}<|channel|>commentary<|message|>Checking.{NEXT}<|channel|>"
         f"commentary to=functions.get_time<|message|>{TIME}<|call|><|start|>assistant{FINAL}Noon.<|return|>",
         "plan", "Checking.\nNoon.", [("get_time", TIME)]),
    Case("two analysis messages", f"{A}one{NEXT}{A}two{NEXT}{FINAL}done", "one\ntwo", "done"),
    Case("no harmony markers", "Just an answer, <b>no</b> markers.", None, "Just an answer, <b>no</b> markers."),
    Case("cut off in the analysis", f"{A}still thinking", "still thinking", ""),
    Case("cut off mid-marker", f"{A}still <|en", "still <|en", "", markup_free=False),
    Case("cut off in a header", f"{A}done{NEXT}<|channel|>fin", "done", ""),
    Case("cut off in a call", f"{A}x{NEXT}<|channel|>commentary to=functions.f<|message|>" + '{"a": ', "x", "",
         [("f", '{"a":')]),
    Case("empty", "", None, ""),
    Case("empty messages", f"{A}{NEXT}{FINAL}<|return|>", None, ""),
    Case("a built-in tool stays in the content", f"{A}search{NEXT}<|channel|>analysis to=browser.search code"
         '<|message|>{"query": "x"}<|call|>', "search",
         '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
         markup_free=False),
]


def pipeline(pieces: list[str]) -> tuple[list[str], list[str], list[Any]]:
    """As ChatOutput streams: the reasoning parser, its content into the tool parser."""
    r, t = GPTOSS.stream(), OPENAI.stream()
    reasoning, content, deltas = [], [], []
    for piece in [*pieces, None]:
        rs, cs = r.feed(piece) if piece is not None else r.finish()
        c, ds = t.feed(cs) if cs else ("", [])
        if piece is None:
            more, later = t.finish()
            c, ds = c + more, ds + later
        reasoning.append(rs)
        content.append(c)
        deltas += ds
    return reasoning, content, deltas


def whole(text: str) -> tuple[str | None, str, list[tuple[str, str]]]:
    reasoning, content = GPTOSS.split(text)
    content, calls = OPENAI.parse(content)
    return reasoning, content, [(c.name, c.arguments) for c in calls]


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_streams_like_whole(text: str, pieces: list[str], markup_free: bool) -> None:
    reasoning, content, calls = whole(text)
    rs, cs, deltas = pipeline(pieces)
    assert ("".join(rs) or None, "".join(cs)) == (reasoning, content)
    assert [(c.name, c.arguments) for c in collect_calls(deltas)] == calls
    seen = set()
    for d in deltas:  # id and name once, first, without arguments
        assert (d.index not in seen) == (d.id is not None and d.name is not None and d.arguments == "")
        seen.add(d.index)
    if markup_free:
        assert not any(m in f for f in rs + cs for m in HARMONY_MARKERS)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_output_splits_into_reasoning_content_and_calls(case):
    assert whole(case.text) == (case.reasoning, case.content, case.calls)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_streaming_in_any_splitting_equals_the_whole(case):
    text = case.text
    assert_streams_like_whole(text, list(text), case.markup_free)
    for cut in range(len(text) + 1):
        assert_streams_like_whole(text, split_at(text, [cut]), case.markup_free)
    rng = random.Random(text)
    for _ in range(30):
        cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(1, 8))]
        assert_streams_like_whole(text, split_at(text, cuts), case.markup_free)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_tool_parser_alone_finds_the_same_calls(case):
    """Without the reasoning parser the analysis stays in the content, as written."""
    content, calls = OPENAI.parse(case.text)
    assert [(c.name, c.arguments) for c in calls] == case.calls
    assert all(c.id.startswith("call_") for c in calls)
    if case.reasoning and not case.calls:
        assert content.startswith(A + case.reasoning.split("\n")[0])


FRAGMENTS = [*HARMONY_MARKERS, "<|", "<|chan", "|>", "assistant", " to=functions.f", "to=browser.x", "analysis",
             "final", "commentary", " json", "{", '"a"', "}", " ", "\n", "hi"]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_mix_of_markup_streams_like_the_whole(data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=20)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert_streams_like_whole(text, split_at(text, cuts), markup_free=False)
    content, deltas = [], []
    s = OPENAI.stream()
    for piece in split_at(text, cuts):
        c, ds = s.feed(piece)
        content.append(c)
        deltas += ds
    c, ds = s.finish()
    parsed, calls = OPENAI.parse(text)
    assert "".join([*content, c]) == parsed
    assert [(k.name, k.arguments) for k in collect_calls(deltas + ds)] == [(k.name, k.arguments) for k in calls]


def test_reasoning_streams_as_it_arrives_holding_a_possible_marker():
    s = GPTOSS.stream()
    assert s.feed("<|channel|>anal") == ("", "")
    assert s.feed("ysis<|message|>Step one") == ("Step one", "")
    assert s.feed(". <|e") == (". ", "")
    assert not s.ended
    assert s.feed("nd|><|start|>assistant<|channel|>final<|message|>") == ("", "")
    assert s.ended
    assert s.feed("Answer") == ("", "Answer")
    assert s.finish() == ("", "")


def test_a_call_goes_out_when_its_message_ends():
    s = OPENAI.stream()
    assert s.feed("<|channel|>commentary to=functions.f<|message|>{\"a\": 1}") == ("", [])
    content, deltas = s.feed("<|call|>")
    assert content == "" and [(c.name, c.arguments) for c in collect_calls(deltas)] == [("f", '{"a": 1}')]


# ---- the server's choices ------------------------------------------------------------------

HARMONY_TEMPLATE = "{%- for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}" \
                   "<|end|>{%- endfor %}{%- if tools %}namespace functions {%- endif %}<|start|>assistant"


class Tok:
    chat_template = HARMONY_TEMPLATE


def test_auto_picks_openai_for_a_harmony_template():
    assert parser_for("auto", HARMONY_TEMPLATE) is OPENAI
    assert tool_format(Tok()) == "openai"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def setup(**kw: Any) -> ChatSetup:
    args: dict[str, Any] = dict(tools=TOOLS, tool_choice=None, parallel=True, grammar=None, template_kwargs={},
                                hf_tokenizer=Tok(), tool_parser="auto", reasoning_parser="openai_gptoss")
    return ChatSetup.of(**{**args, **kw})


def test_the_harmony_parsers_keep_the_markers_and_no_other_setup_does():
    s = setup()
    assert s.tools is OPENAI and s.reasoning is GPTOSS and s.grammar is None
    assert s.keep_special == HARMONY_MARKERS
    assert setup(tools=None).keep_special == HARMONY_MARKERS  # (the reasoning parser reads them)
    assert setup(reasoning_parser=None).keep_special == HARMONY_MARKERS
    assert setup(tool_parser="hermes", reasoning_parser="qwen3").keep_special == ("<tool_call>", "</tool_call>")
    assert setup(tools=None, reasoning_parser=None).keep_special == ()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choices_that_need_a_grammar_are_refused_for_harmony(choice):
    with pytest.raises(ApiError, match="harmony"):
        setup(tool_choice=choice)


def test_a_grammar_after_harmony_reasoning_is_refused():
    from streamer.messages import GrammarSpec

    with pytest.raises(ApiError, match="harmony"):
        setup(tools=None, grammar=GrammarSpec("json_object"))


def test_the_config_and_the_cli_name_the_parsers():
    import argparse

    from streamer.server.serve import add_server_args

    ServerConfig(tool_call_parser="openai", reasoning_parser="openai_gptoss")
    p = argparse.ArgumentParser()
    add_server_args(p)
    args = p.parse_args(["--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("openai", "openai_gptoss")


# ---- the detokenizer, and the API end to end -------------------------------------------------


@pytest.fixture(scope="module")
def harmony_tok(default_model: Path) -> Any:
    """The default model's tokenizer with the harmony markers as special tokens."""
    return marker_tokenizer(default_model, HARMONY_MARKERS, HARMONY_TEMPLATE)


SAMPLE = f"{A}The user wants weather.{NEXT}<|channel|>commentary to=functions.get_weather <|constrain|>json" \
         f"<|message|>{WEATHER}<|call|>"


def test_the_detokenizer_keeps_only_the_markers_asked_for(harmony_tok):
    ids = harmony_tok(SAMPLE + "<|im_end|>", add_special_tokens=False)["input_ids"]
    kept = IncrementalText(harmony_tok, True, HARMONY_MARKERS)
    assert "".join(kept.push([i]) for i in ids) == SAMPLE  # (<|im_end|> is still skipped)
    plain = IncrementalText(harmony_tok, True)
    assert "".join(plain.push([i]) for i in ids) == harmony_tok.decode(ids, skip_special_tokens=True)
    every = IncrementalText(harmony_tok, False, HARMONY_MARKERS)
    assert "".join(every.push([i]) for i in ids) == SAMPLE + "<|im_end|>"


@pytest.fixture
def harmony_api(harmony_tok) -> Iterator[tuple[Detokenizing, TestClient]]:
    engine = Detokenizing(harmony_tok, SAMPLE)
    config = ServerConfig(allowed_hosts=("testserver",), reasoning_parser="openai_gptoss")
    with TestClient(create_app(engine, config)) as client:
        yield engine, client


ASK = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}


def test_a_tool_call_through_the_chat_api(harmony_api):
    engine, client = harmony_api
    r = client.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert engine.sent[-1].params.keep_special_tokens == list(HARMONY_MARKERS)
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == "The user wants weather."
    assert msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": WEATHER}


def test_a_streamed_tool_call_through_the_chat_api(harmony_api):
    _, client = harmony_api
    reasoning, calls, reasons = [], [], []
    with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                d = c["delta"]
                reasoning.append(d.get("reasoning_content") or "")
                assert not d.get("content")
                calls += d.get("tool_calls") or []
                reasons.append(c.get("finish_reason"))
    assert "".join(reasoning) == "The user wants weather."
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"].get("arguments", "") for c in calls) == WEATHER
    assert reasons[-1] == "tool_calls"


def test_without_the_parsers_the_markers_are_skipped_as_before(harmony_tok):
    engine = Detokenizing(harmony_tok, SAMPLE)
    with TestClient(create_app(engine, ServerConfig(allowed_hosts=("testserver",)))) as client:
        r = client.post("/v1/chat/completions", json={"messages": ASK["messages"]})
    assert engine.sent[-1].params.keep_special_tokens == []
    assert r.json()["choices"][0]["message"]["content"] == harmony_tok.decode(
        harmony_tok(SAMPLE)["input_ids"], skip_special_tokens=True)


EFFORT = "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{%- endif %}" + HARMONY_TEMPLATE


def test_reasoning_effort_reaches_a_template_that_reads_it(default_model):
    """gpt-oss's template reads reasoning_effort (its system message's "Reasoning: high"): chat's
    reasoning_effort and the Responses API's reasoning.effort become that template variable,
    and a response echoes its effort; a template without the variable refuses both by name."""
    tok = marker_tokenizer(default_model, HARMONY_MARKERS, EFFORT)
    engine = Detokenizing(tok, SAMPLE)
    config = ServerConfig(allowed_hosts=("testserver",), reasoning_parser="openai_gptoss")
    with TestClient(create_app(engine, config)) as client:
        r = client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "high"})
        assert r.status_code == 200, r.text
        assert engine.sent[-1].chat_template_kwargs == {"reasoning_effort": "high"}
        r = client.post("/v1/responses", json={"input": "Weather in Paris?", "reasoning": {"effort": "low"}})
        assert r.status_code == 200, r.text
        assert engine.sent[-1].chat_template_kwargs == {"reasoning_effort": "low"}
        assert r.json()["reasoning"] == {"effort": "low", "summary": None}
        r = client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "extreme"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    plain = Detokenizing(marker_tokenizer(default_model, HARMONY_MARKERS, HARMONY_TEMPLATE), SAMPLE)
    with TestClient(create_app(plain, config)) as client:
        r = client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "high"})
        assert r.status_code == 400 and "reads no reasoning_effort" in r.json()["error"]["message"]
        assert not plain.sent
