"""SamplingParams.validate: what a request may ask, each refusal naming the field."""

import re

import pytest

from streamer.errors import RequestError
from streamer.sampling_params import SamplingParams


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_k": 0}, "top_k must be -1 (off) or >= 1"),
    ({"n": 0}, "n must be at least 1"),
    ({"stop": ["\n", ""]}, "stop must not hold an empty string"),
    ({"bad_words": [" "]}, "bad_words must not hold an empty"),
    ({"logprobs": 21}, "logprobs must be in [0, 20]"),
])
def test_an_invalid_field_is_refused_by_name(fields, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        SamplingParams(**fields).validate()


def test_stop_strings_and_defaults_pass():
    SamplingParams().validate()
    SamplingParams(stop=["\n\n", "User:"], max_tokens=8, top_k=40, top_p=0.9).validate()
