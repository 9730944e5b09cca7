"""Tree of thought with fork: propose several first steps in parallel branches
(they share the question's prefix in the KV cache and are batched together),
expand each, then let the model pick the most promising plan with select.

    .venv/bin/python examples/lang_tree_of_thought.py
"""

from streamer import LLM
from streamer.lang import EngineBackend, function, gen, select


@function
def tree_of_thought(s, question, width=3):
    s += f"Question: {question}\nLet's consider a few different approaches.\n"
    branches = s.fork(width)
    for i, b in enumerate(branches):
        b += f"Approach {i + 1}:" + gen("step", max_tokens=16, temperature=0.9, seed=i, stop="\n") + "\n"
        b += "Next:" + gen("next", max_tokens=16, temperature=0.7, seed=100 + i, stop="\n")
    plans = [f"{b['step'].strip()} Then {b['next'].strip()}" for b in branches]
    branches.join("step", "next")
    s += "".join(f"Plan {i + 1}: {p}\n" for i, p in enumerate(plans))
    s += "The most promising plan is Plan" + select("best", [f" {i + 1}" for i in range(width)])
    s += ".\nFinal answer:" + gen("answer", max_tokens=24, stop="\n")
    return plans


def main() -> None:
    with LLM("default") as llm:
        st = tree_of_thought.run("How can a small town reduce its traffic jams?", backend=EngineBackend(llm))
        for i, plan in enumerate(st.ret):
            print(f"plan {i + 1}: {plan}")
        print(f"chosen: plan{st['best']}\nanswer:{st['answer']}")
        print(f"branch prefix served from cache: {llm.stats().cached_tokens_total} tokens in all")


if __name__ == "__main__":
    main()
