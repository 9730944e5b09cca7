"""Speculative decoding with a draft model (model/draft.py): greedy output is the plain
greedy output token for token, with a tiny random draft of another family for a tiny random
target and with the default model drafting for itself; batched, chunked, at page sizes 1 and
16, preempted, from a cached prefix; stops never leak; seeded sampling reproduces; grammar
requests speculate too, their output the plain constrained output."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamer import LLM, SamplingParams
from streamer.errors import ConfigError
from tests.conftest import make_tiny_model
from tests.engine.spec.checks import assert_greedy_unchanged, settle

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root / "target", "LlamaForCausalLM", default_model, initializer_range=0.02)
    # another family, other shapes: only the vocabulary is shared
    draft = make_tiny_model(root / "draft", "Qwen3ForCausalLM", None, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                            initializer_range=0.02)
    return target, draft


@pytest.mark.parametrize("page_size, pages, overlap", [(1, 90, False), (16, None, True)])
def test_a_tiny_random_draft_leaves_the_greedy_output_of_a_tiny_target_unchanged(tiny, page_size, pages, overlap):
    target, draft = tiny
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    assert_greedy_unchanged(target, spec, GREEDY, page_size=page_size, pages=pages, overlap=overlap)


@pytest.fixture(scope="module")
def own(default_model):
    spec = {"method": "draft_model", "model": str(default_model), "num_speculative_tokens": 4}
    with LLM(str(default_model), speculative_config=spec) as llm:
        yield llm


PROMPTS = ["The lighthouse keeper climbed the stairs every evening to light the lamp, and every morning "
           "he climbed them again to put it out. One winter night the lighthouse keeper",
           "Numbers: 1, 2, 3, 4, 5,", "Write a haiku about rain."]


def test_the_default_model_drafting_for_itself_keeps_nearly_every_proposal(default_model, own):
    with LLM(str(default_model)) as plain:
        want = plain.generate(PROMPTS, GREEDY)
        plain.wait_idle()
    s0 = own.stats()
    got = own.generate(PROMPTS, GREEDY)
    s1 = own.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    kept = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    assert kept >= 0.9 * (s1.spec_draft_tokens - s0.spec_draft_tokens)
    assert s1.steps - s0.steps <= 24 // 4 + 2, "about one step per 1 + k tokens"
    again = own.generate(PROMPTS[:1], GREEDY)[0]
    assert again.cached_tokens > 0 and again.token_ids == want[0].token_ids
    # a stop string inside a kept run: nothing after it is output
    text = want[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    ps = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    cut = own.generate(PROMPTS[:1], ps)[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    settle(own)


def test_seeded_sampling_reproduces_and_a_draft_equal_to_the_target_is_mostly_kept(own):
    p = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True,
                       repetition_penalty=1.1)
    s0 = own.stats()
    a = [o.token_ids for o in own.generate(PROMPTS, p)]
    s1 = own.stats()
    b = [o.token_ids for o in own.generate(PROMPTS[::-1], p)][::-1]  # (another batch order)
    assert a == b
    assert s1.spec_accepted_tokens - s0.spec_accepted_tokens >= 0.8 * (s1.spec_draft_tokens - s0.spec_draft_tokens)
    settle(own)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def _grammar_params(temperature: float = 0.0, seed: int | None = None) -> list[SamplingParams]:
    import json

    from streamer.messages import GrammarSpec

    return [SamplingParams(max_tokens=40, temperature=temperature, seed=seed,
                           grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
            SamplingParams(max_tokens=16, temperature=temperature, seed=seed,
                           grammar=GrammarSpec("regex", "(yes|no)[.]"))]


GRAMMAR_PROMPTS = ["Give a person as JSON with a name and an age:", "Is water wet? Answer:"]


def test_grammar_requests_speculate_and_keep_the_plain_constrained_output(default_model, own):
    """The draft proposes unconstrained; the scheduler fills each verify row's mask from the
    proposals once they are drawn (Batch.masks_await_drafts), so a refused proposal is never
    kept: greedy output equals plain constrained decoding, beside a speculating request
    without a grammar."""
    import json

    import jsonschema

    params = _grammar_params()
    with LLM(str(default_model)) as plain:
        want = plain.generate(GRAMMAR_PROMPTS, params)
        plain.wait_idle()
    s0 = own.stats()
    got = own.generate([*GRAMMAR_PROMPTS, PROMPTS[0]], [*params, GREEDY])
    s1 = own.stats()
    assert [o.token_ids for o in got[:2]] == [o.token_ids for o in want]
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert got[1].text in ("yes.", "no.")
    assert s1.spec_accepted_tokens > s0.spec_accepted_tokens
    assert s1.masks_deferred > s0.masks_deferred, "the verify rows' masks came from the draws"
    # alone, the JSON request takes far fewer steps than tokens: its proposals are kept
    s2 = own.stats()
    alone = own.generate(GRAMMAR_PROMPTS[:1], params[:1])[0]
    s3 = own.stats()
    assert alone.token_ids == want[0].token_ids
    assert s3.steps - s2.steps <= len(alone.token_ids) // 2
    settle(own)


def test_sampled_grammar_requests_with_a_draft_stay_valid_and_reproduce_their_seed(own):
    import json

    import jsonschema

    params = _grammar_params(temperature=1.0, seed=3)
    a = own.generate(GRAMMAR_PROMPTS, params)
    b = own.generate(GRAMMAR_PROMPTS[::-1], params[::-1])[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    jsonschema.validate(json.loads(a[0].text), SCHEMA)
    assert a[1].text in ("yes.", "no.")
    settle(own)


def test_a_kept_run_ends_where_the_grammar_forces_text_as_plain_decoding_jumps_there(tmp_path, default_model):
    """Plain decoding jumps forward over text the grammar forces (`", "bb": "` in the
    tokenizer's own tokenization); a verify run reaching such a point ends there, and the
    jump follows as it would without speculation: the output is the same. (Dummy SmolLM2
    weights: the masked argmax of random weights spells forced text in other tokens than the
    tokenizer's, so a run kept past the point parts from plain decoding.)"""
    import json
    import shutil

    from streamer.messages import GrammarSpec

    folder = tmp_path / "smollm2-dummy"
    folder.mkdir()
    shutil.copy(Path(__file__).parents[3] / "benchmarks/configs/smollm2-135m/config.json", folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model / f, folder)
    keys = {"type": "object", "properties": {k: {"type": "string", "maxLength": 6} for k in ("a", "bb", "ccc")},
            "required": ["a", "bb", "ccc"]}
    items = {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 6, "maxItems": 6}
    gs = [SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(sc)))
          for sc in (keys, items)]
    prompts = ["Give a person as JSON:", "Say something:"]
    kw = dict(load_format="dummy", num_pages=256)
    with LLM(str(folder), **kw) as plain:
        want = [o.token_ids for o in plain.generate(prompts, gs)]
        plain.wait_idle()
    # (ngram: its proposals copy the model's own runs, so kept runs reach forced text; the
    # draft_model path ends its runs in the same results.verified)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with LLM(str(folder), speculative_config=spec, **kw) as llm:
        got = [o.token_ids for o in llm.generate(prompts, gs)]
        s = llm.stats()
        settle(llm)
    assert got == want
    assert s.jump_forward_tokens > 0 and s.spec_accepted_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_random_draft_under_a_grammar_has_its_refused_proposals_dropped(tiny, overlap):
    """A tiny random draft proposes tokens the grammar mostly refuses: the masks past the
    first refused proposal keep nothing after it, and the output is the target's own
    constrained greedy output (with overlap scheduling too: batches built ahead carry no
    grammar proposals, the others wait for their draws' masks)."""
    from streamer.messages import GrammarSpec

    target, draft = tiny
    g = SamplingParams(max_tokens=24, temperature=0, grammar=GrammarSpec("regex", "[a-z]{3,12}( [a-z]{2,9}){2,4}[.]"))
    prompts = [[5, 17, 99, 5, 17, 300, 41], [1, 2, 3]]
    with LLM(str(target)) as plain:
        want = [o.token_ids for o in plain.generate(prompts, g)]
        plain.wait_idle()
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    with LLM(str(target), speculative_config=spec, overlap_schedule=overlap) as llm:
        got = llm.generate(prompts, g)
        s = llm.stats()
        settle(llm)
    assert [o.token_ids for o in got] == want
    assert s.spec_verifies > 0 and s.spec_draft_tokens > s.spec_accepted_tokens


def test_a_draft_with_another_vocabulary_is_refused_by_name(tmp_path, tiny):
    target, _ = tiny
    other = make_tiny_model(tmp_path / "small-vocab", "LlamaForCausalLM", None, vocab_size=1000)
    with pytest.raises(ConfigError, match="vocabulary has 1000 tokens, the target's 49152"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(other)})


def test_logprobs_of_sampled_tokens_are_the_targets_with_a_draft(default_model, own):
    """A row decided by rejection (its proposal kept, or redrawn) reports the target's
    logprob of the token it holds, as a plain decode would."""
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True, logprobs=2)
    s0 = own.stats()
    out = own.generate(PROMPTS[:1], p)[0]
    assert own.stats().spec_accepted_tokens > s0.spec_accepted_tokens, "the request speculated"
    ids = own.tokenizer(PROMPTS[0])["input_ids"]
    with LLM(str(default_model)) as plain:
        ref = plain.generate([ids + out.token_ids], SamplingParams(max_tokens=1, temperature=0,
                                                                    prompt_logprobs_from=len(ids)))[0]
        plain.wait_idle()
    got = [t.logprob for t in out.logprobs]
    assert all(len(t.top_logprobs) == 2 for t in out.logprobs)
    assert max(abs(a - b) for a, b in zip(got, ref.prompt_logprobs)) < 1e-3
    settle(own)
