"""Few-shot classification with select: every review shares one 5-shot prefix
(served by the radix cache), and each label is chosen by comparing the labels'
log-likelihoods, not by sampling.

    .venv/bin/python examples/lang_few_shot_select.py
"""

from streamer import LLM
from streamer.lang import EngineBackend, function, select

SHOTS = [
    ("The pasta was perfect and the service warm.", "positive"),
    ("Waited an hour for a cold burger.", "negative"),
    ("Best concert I have been to in years!", "positive"),
    ("The battery died after two days.", "negative"),
    ("Lovely staff, spotless room, great view.", "positive"),
]
PREFIX = "Label each review as positive or negative.\n\n" + "".join(
    f"Review: {text}\nLabel: {label}\n\n" for text, label in SHOTS
)


@function
def classify(s, review):
    s += PREFIX + f"Review: {review}\nLabel:"
    s += select("label", [" positive", " negative"])


def main() -> None:
    reviews = [
        "I would happily come back tomorrow.",
        "The screen cracked the first week.",
        "Friendly people and delicious coffee.",
        "Noisy, dirty and overpriced.",
    ]
    with LLM("default") as llm:
        states = classify.run_batch([{"review": r} for r in reviews], backend=EngineBackend(llm))
        for review, st in zip(reviews, states):
            scores = ", ".join(f"{c.strip()} {lp:.2f}" for c, lp in zip(("positive", "negative"),
                                                                           st.meta("label")["logprobs"]))
            print(f"{st['label'].strip():8} ({scores})  {review}")
        stats = llm.stats()
        print(f"prefix cache hit rate {stats.cache_hit_rate:.0%}, largest batch {stats.max_batch_size}")


if __name__ == "__main__":
    main()
