"""select picks the choice of highest log-likelihood, scored in one batched prefill;
the scores equal transformers' float32 log-likelihoods of the same tokens."""

from __future__ import annotations

import pytest
import torch

from streamer.lang import function, select
from streamer.lang.scoring import common_prefix
from streamer.model.default_model import default_model_dir
from tests.oracle import _hf_model

FEW_SHOT = (
    "Classify the sentiment of each review as positive or negative.\n"
    "Review: The food was wonderful and the staff were kind.\nSentiment: positive\n"
    "Review: Cold soup, rude waiter, never again.\nSentiment: negative\n"
    "Review: I loved every minute of the show.\nSentiment:"
)


def reference_scores(prefix: str, choices: list[str]) -> list[float]:
    """log p(choice | prefix) from transformers, with the same tokenization rule as select."""
    from transformers import AutoTokenizer

    path = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    base = tok(prefix)["input_ids"]
    full = [tok(prefix + c)["input_ids"] for c in choices]
    k = max(1, min(common_prefix(base, f) for f in full))
    model = _hf_model(path)
    scores = []
    for ids in full:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        scores.append(sum(logp[i - 1, ids[i]].item() for i in range(k, len(ids))))
    return scores


@function
def classify(s, review_prefix, choices, normalize=False):
    s += review_prefix
    s += select("label", choices, normalize=normalize)


@pytest.mark.parametrize(
    "prefix, choices",
    [
        (FEW_SHOT, [" positive", " negative", " neutral"]),
        # the prefix ends in a space that merges with each choice: scored from one token earlier
        (FEW_SHOT + " ", ["positive", "negative", "mixed feelings"]),
        ("The capital of France is", [" Paris", " London", " the city of Paris"]),
    ],
)
def test_select_matches_transformers_log_likelihoods(backend, prefix, choices):
    st = classify.run(prefix, choices, backend=backend)
    ours = st.meta("label")["logprobs"]
    want = reference_scores(prefix, choices)
    assert ours == pytest.approx(want, abs=1e-3)
    best = max(range(len(choices)), key=want.__getitem__)
    assert st["label"] == choices[best]
    assert st.text() == prefix + choices[best]


def test_normalized_select_uses_the_mean_logprob_per_token(backend):
    choices = [" Paris", " the city of Paris, which is the capital"]
    st = classify.run("The capital of France is", choices, normalize=True, backend=backend)
    m = st.meta("label")
    assert m["normalized"] == pytest.approx([lp / n for lp, n in zip(m["logprobs"], m["tokens"])])
    assert st["label"] == choices[max(range(2), key=m["normalized"].__getitem__)]


def test_choices_share_the_cached_prefix(backend):
    """The second select over the same few-shot prefix finds it in the radix cache."""
    classify.run(FEW_SHOT, [" positive", " negative"], backend=backend)
    st = classify.run(FEW_SHOT, [" positive", " negative"], backend=backend)
    assert min(st.meta("label")["cached_tokens"]) >= 16
