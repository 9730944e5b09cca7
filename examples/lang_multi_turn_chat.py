"""A multi-turn chat rendered with the model's chat template, streaming each reply.

    .venv/bin/python examples/lang_multi_turn_chat.py
"""

from streamer import LLM
from streamer.lang import EngineBackend, assistant, function, gen, system, user


@function
def chat(s, questions):
    s += system("You are a friendly assistant who answers in one sentence.")
    for i, q in enumerate(questions):
        s += user(q)
        s += assistant(gen(f"answer{i}", max_tokens=40, stop="\n"))


def main() -> None:
    questions = ["What is the tallest mountain on Earth?", "How high is it?", "Who first climbed it?"]
    with LLM("default") as llm:
        st = chat.run(questions, backend=EngineBackend(llm), stream=True)
        for i, q in enumerate(questions):
            print(f"user: {q}\nassistant: ", end="", flush=True)
            for delta in st.text_iter(f"answer{i}"):
                print(delta, end="", flush=True)
            print()
        st.wait()
        print(f"\n{len(st.messages())} messages; later turns reuse the conversation from the prefix cache "
              f"({llm.stats().cached_tokens_total} cached tokens)")


if __name__ == "__main__":
    main()
