"""grammar_build: the structural_tag kind, and format_of (any spec as a structural-tag
element), compiled with the default model's tokenizer. (Bad specs of every kind, and the
trial limits, are in test_grammar.py.)"""

from __future__ import annotations

import json

import pytest

from streamer.errors import RequestError
from streamer.messages import GrammarSpec
from streamer.sampling.grammar_build import format_of
from streamer.sampling.grammar_compiler import GrammarCompiler

VOCAB = 49152  # SmolLM2's model vocabulary
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def st(fmt: dict) -> str:
    """A structural_tag spec's value: the structural tag of one format, as JSON text."""
    return json.dumps({"type": "structural_tag", "format": fmt})


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    gc = GrammarCompiler(hf_tokenizer, VOCAB)
    yield gc
    gc.close()


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    """text is a whole sentence of spec."""
    s = compiler.state_for(spec)
    return bool(s.matcher.accept_string(text)) and s.is_completed()


def test_structural_tag_sequence_of_formats(compiler):
    spec = GrammarSpec("structural_tag", st({"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "json_schema", "json_schema": SCHEMA},
        {"type": "regex", "pattern": r" \(confidence [0-9]{2}%\)"},
    ]}))
    assert accepts(compiler, spec, 'Answer: {"name": "Ann", "age": 41} (confidence 90%)')
    assert not accepts(compiler, spec, 'Answer: {"name": "Ann"} (confidence 90%)')  # age is required
    assert not accepts(compiler, spec, 'Answer: {"name": "Ann", "age": 41} (confidence high)')
    assert not accepts(compiler, spec, '{"name": "Ann", "age": 41} (confidence 90%)')


def test_structural_tag_triggered_tags_leave_text_free_until_a_trigger(compiler):
    spec = GrammarSpec("structural_tag", st({"type": "triggered_tags", "triggers": ["<call="], "tags": [
        {"type": "tag", "begin": "<call=person>", "content": {"type": "json_schema", "json_schema": SCHEMA},
         "end": "</call>"}]}))
    assert accepts(compiler, spec, "any text, {braces} and <angles>")
    assert accepts(compiler, spec, 'so: <call=person>{"name": "Ann", "age": 41}</call> done')
    assert not accepts(compiler, spec, "so: <call=animal>{}</call>")
    assert not accepts(compiler, spec, 'so: <call=person>{"name": 5, "age": 41}</call>')


def test_json_in_a_structural_tag_is_fixed_format_like_json_schema(compiler):
    """Plain json_schema elements follow the engine's whitespace policy (compact, forced
    separators); an element that sets max_whitespace_cnt keeps xgrammar's free whitespace."""
    plain = GrammarSpec("structural_tag", st({"type": "json_schema", "json_schema": SCHEMA}))
    assert accepts(compiler, plain, '{"name": "Ann", "age": 41}')
    for loose in ['{"name":"Ann","age":41}', '{ "name": "Ann", "age": 41 }', '{\n  "name": "Ann",\n  "age": 41\n}']:
        assert not accepts(compiler, plain, loose), loose
    assert compiler.state_for(plain).jump_forward_string() == '{"name": "'
    own = GrammarSpec("structural_tag", st({"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 2}))
    assert accepts(compiler, own, '{ "name":"Ann",\n "age": 41}')
    assert not accepts(compiler, own, '{"name":    "Ann", "age": 41}')  # (more than 2)


LANGUAGES = [
    (GrammarSpec("json_object"), ['{"a": [1, {"b": null}]}', "{}"], ['{"a":1}', "[1]", "{"]),
    (GrammarSpec("json_schema", json.dumps(SCHEMA)), ['{"name": "Ann", "age": 41}'],
     ['{"name": "Ann"}', '{"age": 41, "name": "Ann"}', '{"name":"Ann","age":41}']),
    (GrammarSpec("regex", r"(red|green)-[0-9]{2}"), ["red-07", "green-99"], ["red-7", "blue-10", "red-070"]),
    (GrammarSpec("ebnf", 'root ::= "<" [a-z]+ ">"'), ["<ok>"], ["<>", "<OK>", "ok"]),
    (GrammarSpec("choice", '["yes", "no", "say \\"hi\\""]'), ["yes", "no", 'say "hi"'], ["ye", "yesno", ""]),
    (GrammarSpec("structural_tag", st({"type": "const_string", "value": "fixed"})), ["fixed"], ["fix", "fixedd"]),
]


@pytest.mark.parametrize("spec, good, bad", LANGUAGES, ids=lambda x: x.kind if isinstance(x, GrammarSpec) else "")
def test_format_of_a_spec_has_its_language(compiler, spec, good, bad):
    """format_of(kind, value) embeds any spec in a structural tag without changing what it accepts."""
    embedded = GrammarSpec("structural_tag", st(format_of(spec.kind, spec.value)))
    for text in good + bad:
        assert accepts(compiler, embedded, text) == accepts(compiler, spec, text) == (text in good), text


def test_format_of_refuses_what_build_refuses():
    with pytest.raises(RequestError, match="invalid choice: the choices must not be empty strings"):
        format_of("choice", '["a", ""]')
    with pytest.raises(RequestError, match="invalid json_schema: not JSON"):
        format_of("json_schema", "{")
    with pytest.raises(RequestError, match="unknown grammar kind 'xml'; use one of .*, structural_tag"):
        format_of("xml", "")
