"""GrammarCompiler / GrammarState / fill_bitmask with the default model's tokenizer (no model)."""

from __future__ import annotations

import json
import re
import time

import psutil
import pytest
import torch

from streamer.errors import RequestError
from streamer.messages import GrammarSpec
from streamer.sampling.grammar import JUMP_MAX_BYTES, GrammarState, fill_bitmask
from streamer.sampling.grammar_build import choice_grammar
from streamer.sampling.grammar_compiler import GrammarCompiler
from tests.sampling.test_grammar_build import st

VOCAB = 49152  # SmolLM2's model vocabulary


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, VOCAB)


def allowed(state: GrammarState) -> torch.Tensor:
    mask = fill_bitmask([state], VOCAB)
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().bool()[:VOCAB]


def feed(state: GrammarState, tok, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        assert state.accept(t), f"token {t} ({tok.decode([t])!r}) refused"


@pytest.mark.parametrize(
    "spec, needle",
    [
        (GrammarSpec("json_schema", "{not json"), "invalid json_schema: not JSON"),
        (GrammarSpec("json_schema", '{"type": "strange"}'), 'Unsupported type "strange"'),
        (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
        (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "invalid json_schema"),
        (GrammarSpec("regex", "a(b"), "invalid regex: Regex parsing error"),
        (GrammarSpec("regex", "[a-"), "invalid regex"),
        (GrammarSpec("ebnf", 'root ::= "a" undefined'), 'Rule "undefined" is not defined'),
        (GrammarSpec("ebnf", 'start ::= "a"'), 'root rule with name "root" is not found'),
        (GrammarSpec("choice", "[]"), "non-empty JSON list of strings"),
        (GrammarSpec("choice", '["a", 1]'), "non-empty JSON list of strings"),
        (GrammarSpec("choice", '["a", ""]'), "must not be empty strings"),
        (GrammarSpec("choice", "yes|no"), "invalid choice: not a JSON list"),
        (GrammarSpec("structural_tag", "{not json"), "invalid structural_tag: not JSON"),
        (GrammarSpec("structural_tag", '{"type": "structural_tag"}'), '"format": {...}}'),
        (GrammarSpec("structural_tag", '{"type": "tag", "format": {"type": "any_text"}}'),
         'its type must be "structural_tag"'),
        (GrammarSpec("structural_tag", st({"type": "nope"})), "invalid structural_tag: Format type not recognized: nope"),
        (GrammarSpec("structural_tag", st({"type": "triggered_tags", "triggers": ["<x"], "tags": [
            {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}]})),
         "One tag does not match any trigger"),
        (GrammarSpec("structural_tag", st({"type": "json_schema", "json_schema": {"type": "strange"}})),
         'invalid structural_tag: Unsupported type "strange"'),
        (GrammarSpec("structural_tag", st({"type": "grammar", "grammar": 'root ::= "a" x'})),
         'Rule "x" is not defined'),
        (GrammarSpec("xml", "<a/>"), "unknown grammar kind 'xml'"),
    ],
)
def test_bad_specs_are_clear_request_errors(compiler, spec, needle):
    with pytest.raises(RequestError) as e:
        compiler.state_for(spec)
    msg = str(e.value)
    assert needle in msg
    assert ".cc:" not in msg and "Check failed" not in msg  # no C++ noise


def test_cache_by_kind_and_value(compiler):
    spec = GrammarSpec("regex", r"[0-9]{3}")
    a = compiler.compile(spec)
    assert compiler.compile(GrammarSpec("regex", r"[0-9]{3}")) is a
    assert compiler.compile(GrammarSpec("regex", r"[0-9]{4}")) is not a
    # states are fresh matchers over the shared compiled grammar
    s1, s2 = compiler.state_for(spec), compiler.state_for(spec)
    assert s1.matcher is not s2.matcher
    # errors are cached too: a repeated bad spec fails at once
    bad = GrammarSpec("regex", "((")
    for _ in range(2):
        with pytest.raises(RequestError):
            compiler.compile(bad)


def _trial_children(gc: GrammarCompiler) -> list[psutil.Process]:
    """The compilations running in gc's trial process (its forked children)."""
    proc = gc.trials._proc
    return [] if proc is None else psutil.Process(proc.pid).children()


def big_schema(n: int) -> GrammarSpec:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return GrammarSpec("json_schema", json.dumps({"type": "object", "properties": props, "required": list(props)}))


def test_xgrammars_side_is_built_by_the_first_spec_not_at_construction(hf_tokenizer):
    """An engine that never sees a grammar does not pay for TokenizerInfo (~0.3 s) nor start the
    trial process; the first spec builds both, and close() before any spec builds nothing."""
    unused = GrammarCompiler(hf_tokenizer, VOCAB)
    unused.close()
    assert unused._built is None
    gc = GrammarCompiler(hf_tokenizer, VOCAB)
    try:
        assert gc._built is None
        assert isinstance(gc.state_for(GrammarSpec("regex", "[0-9]+")), GrammarState)
        assert gc._built is not None and gc.info.vocab_size == VOCAB
    finally:
        gc.close()


def test_a_tokenizer_xgrammar_cannot_read_fails_its_grammar_requests_only(hf_tokenizer, monkeypatch):
    """Built on first use, xgrammar's side can fail only there: the spec's request gets a
    RequestError naming it (at construction, the engine would not have started at all)."""
    from streamer.sampling import grammar as G

    def broken(*args, **kwargs):
        raise RuntimeError("unknown vocabulary type")

    monkeypatch.setattr(G.xgr.TokenizerInfo, "from_huggingface", broken)
    gc = GrammarCompiler(hf_tokenizer, VOCAB)
    with pytest.raises(RequestError, match="structured output is not available for this model: unknown vocabulary"):
        gc.state_for(GrammarSpec("regex", "[0-9]+"))
    gc.close()


def test_a_compilation_past_its_time_limit_is_killed(hf_tokenizer):
    """A schema of 10,000 properties compiles for minutes: refused at the limit, naming it,
    and nothing goes on compiling it afterwards; the refusal is cached."""
    gc = GrammarCompiler(hf_tokenizer, VOCAB, timeout_s=1.0)
    try:
        gc.state_for(GrammarSpec("regex", "[0-9]+"))  # (the trial process has started)
        t0 = time.monotonic()
        with pytest.raises(RequestError, match=r"took longer than 1 s \(the limit, --grammar-compile-timeout\)"):
            gc.state_for(big_schema(10_000))
        assert time.monotonic() - t0 < 3.0  # (the limit, and the kill)
        assert _trial_children(gc) == []
        t0 = time.monotonic()
        with pytest.raises(RequestError, match="took longer than"):
            gc.state_for(big_schema(10_000))
        assert time.monotonic() - t0 < 0.5  # (no second trial: that would take the limit again)
        assert isinstance(gc.state_for(GrammarSpec("regex", "[a-z]{3}")), GrammarState)  # service goes on
    finally:
        gc.close()


def test_a_structural_tag_compiles_on_trial_too(hf_tokenizer):
    """The schema inside a structural tag is compiled under the same limits as one alone."""
    gc = GrammarCompiler(hf_tokenizer, VOCAB, timeout_s=1.0)
    try:
        schema = json.loads(big_schema(10_000).value)
        with pytest.raises(RequestError, match="compiling the structural_tag grammar took longer than 1 s"):
            gc.state_for(GrammarSpec("structural_tag", st({"type": "json_schema", "json_schema": schema})))
        assert _trial_children(gc) == []
    finally:
        gc.close()


def test_a_compilation_past_its_memory_limit_is_killed(hf_tokenizer):
    gc = GrammarCompiler(hf_tokenizer, VOCAB, memory_bytes=32 << 20)
    try:
        gc.state_for(GrammarSpec("regex", "[0-9]+"))  # (the trial process has started)
        t0 = time.monotonic()
        with pytest.raises(RequestError, match=r"needed more than 32 MB \(the limit, --grammar-compile-memory-mb\)"):
            gc.state_for(big_schema(10_000))
        assert time.monotonic() - t0 < 9.0  # (before the time limit, 10 s)
        assert _trial_children(gc) == []
    finally:
        gc.close()


def test_a_dead_trial_process_is_replaced(hf_tokenizer):
    gc = GrammarCompiler(hf_tokenizer, VOCAB)
    try:
        gc.state_for(GrammarSpec("regex", "x+"))
        gc.trials._proc.kill()
        gc.trials._proc.wait()
        assert isinstance(gc.state_for(GrammarSpec("regex", "y+")), GrammarState)
    finally:
        gc.close()


def test_fill_bitmask_none_rows_are_all_ones(compiler):
    s = compiler.state_for(GrammarSpec("regex", "[ab]+"))
    mask = fill_bitmask([None, s, None], VOCAB)
    assert mask.dtype == torch.int32 and mask.shape == (3, VOCAB // 32)
    assert (mask[0] == -1).all() and (mask[2] == -1).all()
    assert (mask[1] != -1).any()


def test_batch_fill_equals_one_by_one(compiler, hf_tokenizer, monkeypatch):
    import streamer.sampling.grammar as grammar

    monkeypatch.setattr(grammar, "BATCH_FILL_THREADS", 2)
    specs = [
        GrammarSpec("json_object"),
        GrammarSpec("regex", r"\d+(\.\d+)?"),
        GrammarSpec("choice", json.dumps(["alpha", "beta"])),
        GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})),
    ]
    states = [compiler.state_for(s) for s in specs for _ in range(3)]
    feed(states[0], hf_tokenizer, '{"k')
    feed(states[4], hf_tokenizer, "12.")
    states.insert(5, None)
    batched = fill_bitmask(states, VOCAB)  # >= BATCH_FILL_MIN rows: xgrammar's thread pool
    assert grammar._batch_matcher is not None
    for i, s in enumerate(states):
        one = fill_bitmask([s], VOCAB)[0]
        assert torch.equal(batched[i], one), i


def test_choice_accepts_exactly_its_literals(compiler, hf_tokenizer):
    choices = ["yes", "no", 'say "hi"', "back\\slash", "new\nline", "über café", "a|b", "(x)*"]
    assert json.loads(json.dumps(choices)) == choices
    spec = GrammarSpec("choice", json.dumps(choices))
    for c in choices:
        s = compiler.state_for(spec)
        assert s.matcher.accept_string(c), c
        assert s.is_completed()
    for wrong in ["ye", "yess", "maybe", "a"]:
        s = compiler.state_for(spec)
        assert not (s.matcher.accept_string(wrong) and s.is_completed()), wrong
    assert choice_grammar(["a", "a", "b"]) == 'root ::= "a" | "b"'


def test_grammar_ends_with_the_stop_token(compiler, hf_tokenizer):
    s = compiler.state_for(GrammarSpec("choice", '["yes", "no"]'))
    feed(s, hf_tokenizer, "yes")
    assert s.is_completed() and not s.is_terminated()
    ok = allowed(s)
    stop = compiler.info.stop_token_ids
    assert ok[stop].all() and ok.sum() == len(stop)
    assert s.accept(stop[0]) and s.is_terminated()
    assert s.num_accepted == len(hf_tokenizer.encode("yes", add_special_tokens=False)) + 1


def test_rejected_token_is_flagged(compiler, hf_tokenizer):
    s = compiler.state_for(GrammarSpec("regex", "[0-9]+"))
    assert not s.accept(hf_tokenizer.encode("x", add_special_tokens=False)[0])
    assert s.rejected and s.num_accepted == 0


def test_rollback(compiler, hf_tokenizer):
    s = compiler.state_for(GrammarSpec("json_object"))
    before = allowed(s)
    feed(s, hf_tokenizer, '{"a": 1')
    n = s.num_accepted
    s.rollback(n)
    assert s.num_accepted == 0 and torch.equal(allowed(s), before)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_jump_forward_on_fixed_keys(compiler, hf_tokenizer):
    s = compiler.state_for(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    forced = s.jump_forward_string()
    assert forced == '{"name": "'
    toks = s.jump_forward(100)
    text = hf_tokenizer.decode(toks)
    assert toks and forced.startswith(text)
    assert s.num_accepted == len(toks)
    # the rest of the forced text is still forced, and generation goes on from there
    assert s.jump_forward_string() == forced[len(text) :]
    feed(s, hf_tokenizer, forced[len(text) :] + 'Ann"')
    assert s.jump_forward_string() == ', "age": '
    toks = s.jump_forward(100)
    feed(s, hf_tokenizer, ', "age": '[len(hf_tokenizer.decode(toks)) :] + "41}")
    assert s.is_completed()
    assert s.jump_forward(100) == []


def test_jump_forward_respects_limit(compiler):
    s = compiler.state_for(GrammarSpec("regex", "The quick brown fox jumps over the lazy dog\\.[0-9]"))
    assert len(s.jump_forward(2)) == 2 and s.num_accepted == 2
    rest = s.jump_forward(1000)
    assert rest and s.num_accepted == 2 + len(rest)


@pytest.mark.parametrize("grammar", ['root ::= "a" root', 'root ::= "b" | "a" x\nx ::= "a" x'])
def test_jump_forward_of_a_grammar_that_never_ends_is_bounded(compiler, hf_tokenizer, grammar):
    """xgrammar's own jump-forward never returns here (it froze the server); this one takes
    JUMP_MAX_BYTES at most per call, and `limit` tokens at most."""
    s = compiler.state_for(GrammarSpec("ebnf", grammar))
    if "b" in grammar:
        assert s.jump_forward_string() == ""  # a choice first
        feed(s, hf_tokenizer, "a")
    t0 = time.monotonic()
    text = s.jump_forward_string()
    assert text == "a" * JUMP_MAX_BYTES
    toks = s.jump_forward(5)
    assert 0 < len(toks) <= 5 and s.num_accepted == len(toks) + ("b" in grammar)
    assert time.monotonic() - t0 < 0.5


FINITE = [
    GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}},
        "when": {"type": "string", "format": "date"}}, "required": ["name", "tags", "when"]})),
    GrammarSpec("regex", r"(red|green)-[0-9]{2}\.héllo wörld (yes|no)"),
    GrammarSpec("choice", '["north-east", "north-west", "south"]'),
    GrammarSpec("ebnf", 'root ::= "<" tag ">" [a-z]+ "</" tag ">"\ntag ::= "item" | "itemize"'),
]


@pytest.mark.parametrize("spec", FINITE, ids=lambda s: s.kind)
def test_jump_forward_string_is_xgrammars_along_random_walks(compiler, spec):
    """Where xgrammar's own search ends (finite forced text), the bounded one finds the same
    text, at every state of random walks through the grammar."""
    g = torch.Generator().manual_seed(1)
    stop = set(compiler.info.stop_token_ids)
    for _ in range(6):
        s = compiler.state_for(spec)
        for _ in range(40):
            assert s.jump_forward_string() == s.matcher.find_jump_forward_string()
            ok = [t for t in allowed(s).nonzero().flatten().tolist() if t not in stop]
            if not ok:
                break
            assert s.accept(ok[int(torch.randint(len(ok), (1,), generator=g))])


def test_json_object_is_an_object(compiler, hf_tokenizer):
    s = compiler.state_for(GrammarSpec("json_object"))
    assert s.jump_forward_string() == "{"
    feed(s, hf_tokenizer, '{"a": [1, 2.5, "x", null, true], "b": {"c": {}}}')
    assert s.is_completed()


def test_random_walks_stay_in_the_language(compiler, hf_tokenizer):
    """Draw random allowed tokens (no model): every finished walk matches its regex."""
    pattern = r"(red|green|blue)-[0-9]{2,4}(\.[a-z]{1,3})?"
    spec = GrammarSpec("regex", pattern)
    g = torch.Generator().manual_seed(0)
    stop = set(compiler.info.stop_token_ids)
    finished = 0
    for _ in range(8):
        s = compiler.state_for(spec)
        out: list[int] = []
        for _ in range(16):
            ok = allowed(s).nonzero().flatten()
            t = int(ok[torch.randint(len(ok), (1,), generator=g)])
            assert s.accept(t)
            if t in stop:
                break
            out.append(t)
        if s.is_terminated():
            finished += 1
            assert re.fullmatch(pattern, hf_tokenizer.decode(out)), hf_tokenizer.decode(out)
    assert finished >= 4

