"""Incremental text: never a broken character, stop strings never leak."""

import asyncio

import pytest
from transformers import AutoTokenizer

from streamer.engine.detokenizer import IncrementalText, Stream
from streamer.messages import SamplingParams, TokenDelta


@pytest.fixture(scope="module")
def tok(default_model):
    return AutoTokenizer.from_pretrained(str(default_model))


@pytest.mark.parametrize("text", ["Hello 👋🏽 world 🎉!", "日本語のテキストと中文字符", "naïve café — ½ ∑ 🚀🚀"])
def test_multibyte_text_streams_without_replacement_characters(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    inc = IncrementalText(tok, skip_special_tokens=True)
    pieces = [inc.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert any(p == "" for p in pieces) or len(ids) == len(text), "some characters span tokens"


def stream_text(tok, text, stops, chunk=1, include_stop=False):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    s = Stream(tok, SamplingParams(stop=stops, include_stop=include_stop), asyncio.Queue())
    out, reason = [], None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        o, stopped = s.update(TokenDelta("r", ids[i : i + chunk], finish_reason="length" if last else None))
        out.append(o.text)
        if o.finished:
            reason = o.finish_reason
            break
    return "".join(out), reason


def test_stop_string_split_across_tokens_is_cut_before_it(tok):
    text, reason = stream_text(tok, "one two three END four five", ["END four"])
    assert text == "one two three " and reason == "stop"


def test_text_that_only_looks_like_a_stop_prefix_is_released(tok):
    text, reason = stream_text(tok, "one EN two E three", ["END"])
    assert text == "one EN two E three" and reason == "length"


def test_earliest_of_several_stop_strings_wins(tok):
    text, reason = stream_text(tok, "alpha beta gamma delta", ["delta", "beta"], chunk=3)
    assert text == "alpha " and reason == "stop"


@pytest.mark.parametrize("chunk", [1, 4])
def test_include_stop_keeps_the_matched_stop_string_and_nothing_after_it(tok, chunk):
    text, reason = stream_text(tok, "one two three END four five", ["END four"], chunk, include_stop=True)
    assert text == "one two three END four" and reason == "stop"
    text, reason = stream_text(tok, "alpha beta gamma delta", ["delta", "beta"], chunk, include_stop=True)
    assert text == "alpha beta" and reason == "stop"


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_fast_path_gives_transformers_text(tok, skip):
    import random

    inc = IncrementalText(tok, skip_special_tokens=skip)
    assert inc.backend is not None, "the default model's tokenizer has no clean-up pass"
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
        assert inc._decode(ids) == tok.decode(ids, skip_special_tokens=skip)


def test_a_bpe_tokenizer_asking_for_clean_up_decodes_as_transformers_does(tok):
    """Llama 3's tokenizer asks for the clean-up pass, which transformers skips for BPE: the
    Rust decode is then used, and its text is still transformers' (spaces before punctuation
    kept)."""
    import copy

    bpe = copy.deepcopy(tok)
    bpe.clean_up_tokenization_spaces = True
    inc = IncrementalText(bpe, skip_special_tokens=True)
    ids = bpe.encode("Hello , world . It 's fine ! isn 't it ?")
    assert inc._decode(ids) == bpe.decode(ids, skip_special_tokens=True)
    flag = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    if hasattr(bpe, flag):
        assert inc.backend is not None
        setattr(bpe, flag, True)  # clean-up forced: the slow path, and its cleaned text
        forced = IncrementalText(bpe, skip_special_tokens=True)
        assert forced.backend is None and forced._decode(ids) == bpe.decode(ids, skip_special_tokens=True)


def test_a_stop_string_inside_a_multi_token_delta_cuts_the_tokens_after_it(tok):
    # a kept run of speculative decoding (or a grammar's jump) arrives as one delta
    ids = tok("alpha beta gamma delta epsilon", add_special_tokens=False)["input_ids"]
    s = Stream(tok, SamplingParams(stop=[" gam"]), asyncio.Queue())
    out, stopped = s.update(TokenDelta("r", ids))
    assert stopped and out.finished and out.text == "alpha beta"
    upto = next(i for i in range(1, len(ids) + 1) if " gam" in tok.decode(ids[:i]))
    assert out.token_ids == ids[:upto] and out.completion_tokens == upto < len(ids)
