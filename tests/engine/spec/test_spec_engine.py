"""Speculative decoding (ngram) end to end on the default model: the greedy output is the
plain greedy output token for token (and transformers'), whatever the batch, the chunking,
the page size, the pool or the cache; stops end a request inside an accepted run; seeded
sampling gives the same output with and without speculation."""

from __future__ import annotations

import msgspec
import pytest

from streamer import LLM, SamplingParams
from tests.engine.spec.checks import settle
from tests.oracle import Comparison, compare

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "def describe(width, height):\n    return f'{width}x{height}: area {area(width, height)}'\n"
)


@pytest.fixture(scope="module")
def tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model))


@pytest.fixture(scope="module")
def prompts(tok):
    """An input-grounded prompt (the answer copies the code) and two plain ones."""
    chat = [{"role": "user", "content": "Rewrite this code, renaming width to w:\n\n" + CODE}]
    grounded = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
    story = tok("The lighthouse keeper climbed the stairs every evening. The lighthouse keeper")["input_ids"]
    short = tok("Numbers: 1, 2, 3, 4, 5,")["input_ids"]
    return [grounded, story, short]


@pytest.fixture(scope="module")
def plain(default_model, prompts):
    with LLM(str(default_model)) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(plain, prompts):
    return [o.token_ids for o in gen(plain, prompts, GREEDY)]


@pytest.fixture(scope="module")
def spec(default_model):
    with LLM(str(default_model), speculative_config=SPEC) as llm:
        yield llm


def gen(llm: LLM, prompts, params):
    """generate, then wait for the engine to idle: two engines of one process must not step at
    once (a request ended by a stop string may still be in a step when its output is back)."""
    out = llm.generate(prompts, params)
    llm.wait_idle()
    return out


def test_batched_greedy_equals_plain_greedy_and_transformers(default_model, spec, prompts, expected):
    s0 = spec.stats()
    got = [o.token_ids for o in gen(spec, prompts, GREEDY)]
    s = spec.stats()
    assert got == expected
    cmp = Comparison()
    compare(default_model, prompts[0], got[0], cmp)
    assert not cmp.failures, cmp.failures
    assert s.spec_draft_tokens > s0.spec_draft_tokens and s.spec_accepted_tokens > s0.spec_accepted_tokens
    settle(spec)


def test_input_grounded_output_accepts_most_proposals_in_fewer_steps(default_model, spec, plain, prompts, expected):
    p0, s0 = plain.stats(), spec.stats()
    gen(plain, [prompts[0]], GREEDY)
    got = gen(spec, [prompts[0]], GREEDY)[0].token_ids
    p1, s1 = plain.stats(), spec.stats()
    assert got == expected[0]
    drafted = s1.spec_draft_tokens - s0.spec_draft_tokens
    kept = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    assert kept / drafted > 0.5, (kept, drafted)
    assert (s1.steps - s0.steps) * 2 <= p1.steps - p0.steps, "at least half the steps saved"
    per_pos = s1.spec_accepted_per_position
    assert per_pos == sorted(per_pos, reverse=True), "a later proposal is kept only after the earlier ones"


@pytest.mark.parametrize("page_size, chunk, pages", [(1, 7, 150), (16, 5, None)])
def test_chunked_prefill_page_sizes_and_preemption(default_model, prompts, expected, page_size, chunk, pages):
    # 150 pages of 1 token: the three requests (137, 44 and 49 tokens at the end) take turns
    with LLM(str(default_model), speculative_config=SPEC, page_size=page_size, max_num_batched_tokens=chunk,
             num_pages=pages) as llm:
        got = [o.token_ids for o in gen(llm, prompts, GREEDY)]
        s = llm.stats()
        assert s.spec_accepted_tokens > 0
        assert (s.preemptions > 0) == (pages is not None)
        settle(llm)
    assert got == expected


def test_a_cached_prefix_gives_the_same_output(spec, prompts, expected):
    first = gen(spec, [prompts[0]], GREEDY)[0]
    again = gen(spec, [prompts[0]], GREEDY)[0]
    assert again.cached_tokens > 0
    assert first.token_ids == again.token_ids == expected[0]
    settle(spec)


def test_stops_end_inside_an_accepted_run(plain, spec, prompts, expected):
    out = expected[0]
    # a token some way in that the grounded answer repeats: the stop lands inside a kept run
    stop_at = next(i for i in range(8, len(out)) if out[i] in out[:i])
    p = SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[out[stop_at]])
    first = out.index(out[stop_at])
    assert gen(spec, [prompts[0]], p)[0].token_ids == out[: first + 1]
    text = gen(plain, [prompts[0]], GREEDY)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    ps = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop])
    a, b = gen(plain, [prompts[0]], ps)[0], gen(spec, [prompts[0]], ps)[0]
    assert b.text == a.text and stop not in b.text and b.finish_reason == "stop"
    assert b.token_ids == a.token_ids and b.completion_tokens == a.completion_tokens, "no token after the stop"
    for n in (1, 2, 7):  # max_tokens inside a run
        pm = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        assert gen(spec, [prompts[0]], pm)[0].token_ids == out[:n]
    settle(spec)


def test_seeded_sampling_is_the_same_with_and_without_speculation(plain, spec, prompts):
    # every knob of the target distribution: each output position draws its own seeded uniform
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, min_p=0.05, seed=8, repetition_penalty=1.2,
                       logit_bias={13: 2.0}, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3, seed=9,
                       min_tokens=4, ignore_eos=False),
    ]
    want = [o.token_ids for o in gen(plain, prompts, params)]
    s0 = spec.stats()
    got = [o.token_ids for o in gen(spec, prompts, params)]
    assert spec.stats().spec_accepted_tokens > s0.spec_accepted_tokens
    assert got == want
    assert [o.token_ids for o in gen(spec, prompts, params)] == got  # (reproduced)


def test_logprobs_of_kept_tokens_are_those_of_plain_decoding(plain, spec, prompts):
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    a, b = gen(plain, [prompts[0]], p)[0], gen(spec, [prompts[0]], p)[0]
    assert a.token_ids == b.token_ids
    assert a.logprobs is not None and b.logprobs is not None and len(b.logprobs) == 12
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top_logprobs or []] == [t for t, _ in y.top_logprobs or []]


def test_a_json_schema_request_with_speculation_is_valid_json_and_the_plain_output(plain, spec, tok):
    import json

    from streamer.messages import GrammarSpec

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
              "items": {"type": "string"}}}, "required": ["name", "tags"]}
    doc = '{"name": "lighthouse", "tags": ["sea", "light", "night"]}'
    chat = [{"role": "user", "content": f"Repeat this JSON exactly: {doc}"}]
    ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
    p = SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    a, s0 = gen(plain, [ids], p)[0], spec.stats()
    b = gen(spec, [ids], p)[0]
    assert b.error is None and b.token_ids == a.token_ids
    json.loads(b.text)
    assert spec.stats().spec_accepted_tokens > s0.spec_accepted_tokens
    settle(spec)


def test_overlap_scheduling_with_speculation_gives_the_plain_output(default_model, plain, prompts, expected):
    """Requests with a verify chunk in flight wait for it; those whose proposals keep failing
    decode ahead of their tokens (spec/rollback.py: ahead_budget); a grammar request beside
    them gets no proposals in batches built ahead (its masks are deferred there)."""
    import json

    from streamer.messages import GrammarSpec

    g = SamplingParams(max_tokens=24, temperature=0, grammar=GrammarSpec("json_object"))
    want_json = gen(plain, [prompts[2]], g)[0]
    with LLM(str(default_model), speculative_config=SPEC, overlap_schedule=True) as llm:
        llm.engine.scheduler.jump_forward = False  # (jump-forward turns scheduling ahead off)
        outs = gen(llm, [*prompts, prompts[2]], [GREEDY] * len(prompts) + [g])
        s = llm.stats()
        settle(llm)
    assert [o.token_ids for o in outs[:-1]] == expected
    assert outs[-1].token_ids == want_json.token_ids
    if outs[-1].finish_reason == "stop":
        json.loads(outs[-1].text)
    assert s.spec_accepted_tokens > 0 and s.steps_ahead > 0



class EagerRows:
    """In place of the GPU's rows-as-decode graphs (runner.row_graphs, CUDA only): the verify
    steps of a lone request go through exact_verify.verify_rows as decode rows, run eagerly here."""

    def __init__(self, max_bs: int) -> None:
        self.max_bs, self.steps = max_bs, 0

    def fits(self, batch_size: int, width: int) -> bool:
        self.steps += 1
        return batch_size <= self.max_bs


def test_verify_steps_as_decode_rows_give_the_plain_output(default_model, prompts, expected):
    """The path that makes bf16 greedy output with speculation equal plain decoding's on the GPU
    (each verify row computed as a lone decode row): one sequence's proposals as that many decode
    rows, each attending to its own prefix, give the verify step's tokens here too."""
    with LLM(str(default_model), speculative_config=SPEC) as llm:
        rows = llm.engine.runner.row_graphs = EagerRows(SPEC["num_speculative_tokens"] + 1)
        got = [gen(llm, [p], GREEDY)[0].token_ids for p in prompts]  # one at a time: batch 1
        s = llm.stats()
        assert rows.steps > 0, "verify steps went through the decode rows"
        assert got == expected
        assert s.spec_accepted_tokens > 0
        settle(llm)


def test_no_proposals_while_the_batch_is_at_disable_by_batch_size(default_model, prompts, expected):
    """With disable_by_batch_size 2, three requests decode plainly until one is left, which
    then speculates; the output is the plain output either way."""
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    spec = dict(SPEC, disable_by_batch_size=2)
    for overlap in (False, True):
        with LLM(str(default_model), speculative_config=spec, overlap_schedule=overlap) as llm:
            runner = llm.engine.runner
            sizes: list[tuple[int, bool]] = []  # per step: (sequences, whether any verifies)
            launch = runner.launch

            def record(batch, launch=launch, sizes=sizes):
                sizes.append((len(batch.seqs), any(c.num_draft for c in batch.seqs)))
                return launch(batch)

            runner.launch = record
            got = gen(llm, prompts, [GREEDY, short, short])
            s = llm.stats()
            del runner.launch
            settle(llm)
        assert got[0].token_ids == expected[0]
        assert [o.token_ids for o in got[1:]] == [e[:6] for e in expected[1:]]
        assert s.spec_verifies > 0 and s.spec_accepted_tokens > 0
        assert all(n == 1 for n, verifies in sizes if verifies), sizes
        assert any(n == 3 for n, _ in sizes), "the three decoded together first"


def test_a_prediction_is_followed_and_the_output_stays_the_plain_output(plain, spec, prompts, expected, tok):
    """Predicted Outputs: the story's answer given as the prediction is proposed and kept
    whole, k + 1 tokens a step (prompt lookup alone keeps less than half its proposals there);
    a prediction with a wrong middle, an unrelated one and token ids give the plain output
    all the same."""
    story, want = prompts[1], expected[1]
    s0 = spec.stats()
    assert gen(spec, [story], GREEDY)[0].token_ids == want
    s1 = spec.stats()
    text = tok.decode(want)
    exact = msgspec.structs.replace(GREEDY, prediction=text)
    assert gen(spec, [story], exact)[0].token_ids == want
    s2 = spec.stats()
    k = SPEC["num_speculative_tokens"]
    assert s2.spec_accepted_tokens - s1.spec_accepted_tokens == s2.spec_draft_tokens - s1.spec_draft_tokens > 0
    assert s2.steps - s1.steps <= 2 + (len(want) - 1) // (k + 1), "the prefill, then k + 1 tokens a step"
    assert s2.steps - s1.steps < s1.steps - s0.steps
    half = len(text) // 2
    for prediction in (text[: half - 20] + " an unexpected storm rolled in" + text[half:],
                       "Completely different words about the sea.", want[5:], [0]):
        got = gen(spec, [story], msgspec.structs.replace(GREEDY, prediction=prediction))[0]
        assert got.token_ids == want, prediction
    # without ngram speculation a prediction changes nothing either; either way the output
    # carries it as tokens, for usage's accepted and rejected prediction tokens
    for llm in (plain, spec):
        out = gen(llm, [story], exact)[0]
        assert out.token_ids == want
        assert out.prediction_token_ids == list(tok(text, add_special_tokens=False)["input_ids"])
    assert gen(plain, [story], GREEDY)[0].prediction_token_ids is None
    settle(spec)


def test_a_prediction_outside_the_vocabulary_or_the_context_is_refused(spec, prompts):
    for prediction, word in (([10**9], "outside the vocabulary"), ([1] * 10_000, "more than the context")):
        out = gen(spec, [prompts[2]], msgspec.structs.replace(GREEDY, prediction=prediction))[0]
        assert out.finish_reason == "error" and word in out.error
