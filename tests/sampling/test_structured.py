"""Structured output end to end on the default model: JSON schemas, regex, choice, errors,
jump-forward and preemption."""

from __future__ import annotations

import collections
import json
import random
import re

import jsonschema
import msgspec
import pytest

from streamer.engine.scheduler import Scheduler
from streamer.messages import GrammarSpec, SamplingParams

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "active"],
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["user", "tags"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "size": {"enum": ["S", "M", "L"]},
            "kind": {"type": "string", "enum": ["shirt", "hat"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["size", "kind", "count"],
    },
    "bounded": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -50, "maximum": 50},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["score", "ratio", "ok"],
    },
    "list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "k": {"enum": ["x", "y"]},
                        "v": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["k", "v"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
}


def chat(llm, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    ids = llm.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def json_spec(name: str) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(SCHEMAS[name]))


def test_fifty_json_schema_requests_in_one_batch(llm):
    rng = random.Random(5)
    names = list(SCHEMAS)
    prompts, params, which = [], [], []
    for i in range(50):
        name = names[i % len(names)]
        prompts.append(f"A {name} record as JSON:")  # short prompts: the CPU prefill is slow
        t = round(rng.uniform(0.0, 1.3), 2)
        params.append(SamplingParams(temperature=t, seed=i, max_tokens=96, grammar=json_spec(name)))
        which.append(name)
    outs = llm.generate(prompts, params)
    reasons = collections.Counter(o.finish_reason for o in outs)
    print("finish reasons:", dict(reasons))
    for o, name, p in zip(outs, which, params):
        assert o.error is None
        assert o.finish_reason == "stop", (name, p.temperature, o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMAS[name])
    llm.check()


def test_regex_and_choice_always_match(llm):
    patterns = [
        r"\(\d{3}\) \d{3}-\d{4}",
        r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d",
        r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?",
    ]
    choices = ["Paris", "London", "Rome", "New York", "Tōkyō"]
    prompts, params, checks = [], [], []
    for i in range(12):
        pat = patterns[i % 3]
        prompts.append(chat(llm, "Give me a phone number, a date or a name."))
        params.append(
            SamplingParams(temperature=1.0, seed=i, max_tokens=32, grammar=GrammarSpec("regex", pat))
        )
        checks.append(lambda s, pat=pat: re.fullmatch(pat, s) is not None)
    for i in range(8):
        prompts.append(chat(llm, "What is the capital of France?"))
        params.append(
            SamplingParams(
                temperature=1.2, seed=i, max_tokens=16, grammar=GrammarSpec("choice", json.dumps(choices))
            )
        )
        checks.append(lambda s: s in choices)
    outs = llm.generate(prompts, params)
    for o, ok in zip(outs, checks):
        assert o.finish_reason == "stop", o
        assert ok(o.text), o.text


def test_grammar_beats_min_tokens(llm):
    spec = GrammarSpec("choice", json.dumps(["yes", "no"]))
    (o,) = llm.generate(
        [chat(llm, "Yes or no?")],
        [SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8, grammar=spec)],
    )
    assert o.text in ("yes", "no") and o.finish_reason == "stop"


def test_invalid_grammars_fail_alone(llm):
    good = [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=64, grammar=json_spec("enums")),
    ]
    prompt = chat(llm, "Describe a shirt as JSON.")
    expect = llm.generate([prompt, prompt], good)
    bad = [
        SamplingParams(
            max_tokens=10, grammar=GrammarSpec("json_schema", '{"type": "object", "properties": 3')
        ),
        SamplingParams(max_tokens=10, grammar=GrammarSpec("regex", "[0-9")),
        SamplingParams(max_tokens=10, grammar=GrammarSpec("json_schema", '{"type": "nonsense"}')),
    ]
    outs = llm.generate([prompt] * 5, [bad[0], good[0], bad[1], good[1], bad[2]])
    for o in (outs[0], outs[2], outs[4]):
        assert o.finish_reason == "error" and o.error and o.token_ids == []
    assert "json_schema" in outs[0].error and "regex" in outs[2].error and "nonsense" in outs[4].error
    assert outs[1].token_ids == expect[0].token_ids
    assert outs[3].token_ids == expect[1].token_ids and outs[3].finish_reason == "stop"


def test_logprobs_with_a_grammar(llm):
    spec = json_spec("person")
    (o,) = llm.generate(
        [chat(llm, "A person as JSON.")],
        [SamplingParams(temperature=0.0, max_tokens=48, logprobs=3, grammar=spec)],
    )
    assert o.finish_reason == "stop"
    jsonschema.validate(json.loads(o.text), SCHEMAS["person"])
    # no jump-forward for logprobs requests: one entry per token, of the masked distribution
    assert len(o.logprobs) == len(o.token_ids)
    assert o.logprobs[0].top_logprobs[0][0] == o.token_ids[0]
    first_allowed = {t for t in range(len(llm.tokenizer)) if llm.tokenizer.decode([t]).startswith("{")}
    assert all(t in first_allowed for t, _ in o.logprobs[0].top_logprobs if _ > float("-inf"))


def run_counted(llm, prompts, params):
    s0 = llm.stats()
    outs = llm.generate(prompts, params)
    s1 = llm.stats()
    return outs, s1.steps - s0.steps, s1.jump_forward_tokens - s0.jump_forward_tokens


def test_grammars_that_never_end_run_to_max_tokens(llm):
    """Forced text without end (`root ::= "a" root`, a schema whose required property is the
    schema itself): each request stops at exactly max_tokens with "length", in a few steps,
    and no step takes more than JUMP_STEP_BYTES of jumps for all of them together."""
    from streamer.sampling.grammar import JUMP_STEP_BYTES

    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    specs = [GrammarSpec("ebnf", 'root ::= "a" root'), GrammarSpec("json_schema", json.dumps(recursive))]
    n, max_tokens = 8, 200
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, grammar=specs[i % 2]) for i in range(n)]
    outs, steps, jumped = run_counted(llm, ["Go:"] * n, params)
    for i, o in enumerate(outs):
        assert o.finish_reason == "length" and len(o.token_ids) == max_tokens, o.finish_reason
        assert set(o.text) == {"a"} if i % 2 == 0 else o.text.startswith('{"a": {"a": ')
    print(f"{steps} steps, {jumped} of {n * max_tokens} tokens jumped")
    assert jumped > n * max_tokens / 2 and steps < max_tokens / 4
    assert steps * JUMP_STEP_BYTES >= jumped  # (every forced token here is at least one byte)
    llm.check()


def test_jump_forward_saves_decode_steps(llm):
    names = ["person", "nested", "enums", "list"]
    prompts = [f"{n} as JSON:" for n in names]
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=96, grammar=json_spec(n))
        for i, n in enumerate(names)
    ]
    results = {}
    try:
        for jf in (False, True):
            Scheduler.jump_forward = jf
            results[jf] = run_counted(llm, prompts, params)
    finally:
        Scheduler.jump_forward = True
    for outs, _steps, _jumped in results.values():
        for o, p in zip(outs, params):
            assert o.finish_reason == "stop", o
            jsonschema.validate(json.loads(o.text), json.loads(p.grammar.value))
    (steps_off, jumped_off), (steps_on, jumped_on) = results[False][1:], results[True][1:]
    print(f"steps: {steps_off} without jump-forward, {steps_on} with ({jumped_on} tokens jumped)")
    assert jumped_off == 0 and jumped_on > 0
    assert steps_on < steps_off


@pytest.fixture(scope="module")
def small_pool_llm():
    from streamer.engine.llm import LLM

    engine = LLM("default", num_pages=24, page_size=8)
    yield engine
    engine.close()


def test_grammar_survives_preemption(small_pool_llm):
    llm = small_pool_llm
    names = list(SCHEMAS)
    prompts = [f"Record {i} ({names[i % 5]}) as JSON:" for i in range(8)]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, grammar=json_spec(names[i % 5]))
        for i in range(8)
    ]
    # the grammars compiled first, so that all 8 requests are admitted together and outgrow the
    # pool (compiled while they ran, on a loaded machine, they joined one by one and none was preempted)
    llm.generate(prompts[:5], [msgspec.structs.replace(p, max_tokens=1) for p in params[:5]])
    outs = llm.generate(prompts, params)
    assert llm.stats().preemptions > 0
    for o, p in zip(outs, params):
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), json.loads(p.grammar.value))
    llm.check()


def test_masks_filled_while_the_next_step_runs(llm):
    """With overlap scheduling, a grammar batch is built and its forward launched before
    the previous step's tokens are known; its bitmask follows once they have moved the
    matchers. Outputs equal those of the plain schedule, and stay valid."""
    from streamer.engine.llm import LLM

    rng = random.Random(7)
    prompts, params = [], []
    names = list(SCHEMAS)
    for i in range(8):
        name = names[i % len(names)]
        prompts.append(chat(llm, f"Describe a {name} as JSON."))
        grammar = GrammarSpec("json_schema", json.dumps(SCHEMAS[name]))
        params.append(SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), seed=i, max_tokens=80, grammar=grammar))
    prompts.append(chat(llm, "Pick a colour."))
    params.append(SamplingParams(temperature=0.0, max_tokens=8, grammar=GrammarSpec("choice", '["red", "blue"]')))
    prompts.append(chat(llm, "Say hello."))
    params.append(SamplingParams(temperature=0.0, max_tokens=12))  # unconstrained, same batches
    llm.engine.scheduler.jump_forward = False
    try:
        want = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
    finally:
        llm.engine.scheduler.jump_forward = True
    with LLM("default", overlap_schedule=True) as ov:
        ov.engine.scheduler.jump_forward = False
        outs = ov.generate(prompts, params)
        s = ov.stats()
        ov.check()
        assert s.steps_ahead > 0 and s.masks_deferred > 0, "grammar batches were scheduled ahead"
    assert [(o.token_ids, o.finish_reason) for o in outs] == want
    for o, p in zip(outs[:8], params[:8]):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), json.loads(p.grammar.value))
    assert outs[8].text in ("red", "blue")
