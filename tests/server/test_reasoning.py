"""Reasoning split (server/reasoning.py): what each convention splits an output into, that
streaming it in any splitting emits exactly that without tag text, and when `ended` flips."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.server.reasoning import REASONING_PARSERS

TAGS = ("<think>", "</think>")

CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("qwen3", "\n<think>\nA\n\nB\n</think>\n\nC\n", "A\n\nB", "C\n"),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "\n\n  Indented answer. ", None, "\n\n  Indented answer. "),
    ("qwen3", "<think>\nStill thinking", "Still thinking", ""),
    ("qwen3", "<think>\n\n</think>\n\nHi", None, "Hi"),
    ("qwen3", "<thinker> says hi", None, "<thinker> says hi"),
    ("qwen3", "Answer first <think>x</think>", None, "Answer first <think>x</think>"),
    ("qwen3", "<think>a </thin b < c</think>d", "a </thin b < c", "d"),
    ("qwen3", "<think>r</think>", "r", ""),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>\nx\n</think>\n\ny", "x", "y"),
    ("deepseek_r1", "All of it is reasoning", "All of it is reasoning", ""),
    ("deepseek_r1", "</think>\n\nJust the answer", None, "Just the answer"),
    ("deepseek_r1", "<thin", "<thin", ""),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "", None, ""),
]
IDS = [f"{p}-{i}" for i, (p, *_) in enumerate(CASES)]


def streamed(parser: str, pieces: list[str]) -> tuple[list[str], list[str]]:
    s = REASONING_PARSERS[parser].stream()
    out = [s.feed(p) for p in pieces] + [s.finish()]
    return [r for r, _ in out], [c for _, c in out]


def assert_streams_like_split(parser: str, text: str, pieces: list[str], tag_free: bool = True) -> None:
    reasoning, content = REASONING_PARSERS[parser].split(text)
    r, c = streamed(parser, pieces)
    assert ("".join(r) or None, "".join(c)) == (reasoning, content)
    if tag_free:
        assert not any(tag in f for f in r + c for tag in TAGS)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def tag_free(content: str) -> bool:
    return not any(tag in content for tag in TAGS)


@pytest.mark.parametrize("parser, text, reasoning, content", CASES, ids=IDS)
def test_split_gives_the_reasoning_and_the_content(parser, text, reasoning, content):
    assert REASONING_PARSERS[parser].split(text) == (reasoning, content)


@pytest.mark.parametrize("parser, text, reasoning, content", CASES, ids=IDS)
def test_streaming_in_any_splitting_equals_split(parser, text, reasoning, content):
    free = tag_free(content)
    assert_streams_like_split(parser, text, list(text), free)
    for cut in range(len(text) + 1):
        assert_streams_like_split(parser, text, split_at(text, [cut]), free)
    rng = random.Random(text)
    for _ in range(50):
        cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(1, 8))]
        assert_streams_like_split(parser, text, split_at(text, cuts), free)


@pytest.mark.parametrize("parser", REASONING_PARSERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_text_streams_like_split(parser, data):
    pieces = ["<think>", "</think>", "<thi", "</th", "<", "/", ">", "\n", " ", "a", "b c"]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=16)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert_streams_like_split(parser, text, split_at(text, cuts), tag_free=False)


def ended_at(parser: str, text: str) -> int | None:
    """The index of the character whose feeding set `ended`, fed one at a time."""
    s = REASONING_PARSERS[parser].stream()
    for i, ch in enumerate(text):
        s.feed(ch)
        if s.ended:
            return i
    return None


@pytest.mark.parametrize(
    "parser, text",
    [("qwen3", "<think>\nhm\n</think>\n\nok"), ("deepseek_r1", "hm\n</think>\n\nok"),
     ("deepseek_r1", "<think>hm</think>ok")],
)
def test_ended_flips_when_the_end_tag_completes(parser, text):
    assert ended_at(parser, text) == text.index("</think>") + len("</think>") - 1


def test_qwen3_without_a_think_block_has_ended_at_its_first_non_whitespace_character():
    assert ended_at("qwen3", "\n\n  The answer") == 4


def test_qwen3_decides_a_lookalike_tag_at_the_character_that_departs_from_it():
    assert ended_at("qwen3", "<thinker>") == 6


@pytest.mark.parametrize("parser, text", [("qwen3", "<think>\nnever closed"), ("deepseek_r1", "never closed")])
def test_unterminated_reasoning_never_ends(parser, text):
    s = REASONING_PARSERS[parser].stream()
    s.feed(text)
    s.finish()
    assert not s.ended


def test_reasoning_streams_as_it_arrives_holding_a_possible_end_tag_and_trailing_whitespace():
    s = REASONING_PARSERS["qwen3"].stream()
    assert s.feed("  <thi") == ("", "")
    assert s.feed("nk>\nStep one") == ("Step one", "")
    assert s.feed(".\n</th") == (".", "")
    assert s.feed("ink>\n\n") == ("", "")
    assert s.ended
    assert s.feed("Answer") == ("", "Answer")
    assert s.finish() == ("", "")
