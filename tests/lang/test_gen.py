"""gen: plain, under a regex / JSON schema / choices; streaming; chat turns."""

from __future__ import annotations

import json
import re

import jsonschema

from streamer.lang import assistant, assistant_begin, assistant_end, function, gen, system, user

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@function
def structured(s):
    s += "A famous year in history: " + gen("year", max_tokens=6, regex=r"(19|20)[0-9]{2}") + "\n"
    s += "A person as JSON: " + gen("person", max_tokens=40, json_schema=PERSON) + "\n"
    s += "Is the sky blue? " + gen("yn", max_tokens=4, choices=["yes", "no"])


def test_grammar_constrained_gens_validate(backend):
    st = structured.run(backend=backend)
    assert re.fullmatch(r"(19|20)[0-9]{2}", st["year"])
    jsonschema.validate(json.loads(st["person"]), PERSON)
    assert st["yn"] in ("yes", "no")
    assert st.meta("person")["finish_reason"] == "stop"


@function
def chat(s, question):
    s += system("You are terse.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8))
    s += user("Thanks.")
    s += assistant_begin()
    s += "You are " + gen("reply", max_tokens=4)
    s += assistant_end()


def test_role_helpers_render_the_chat_template(backend, llm):
    st = chat.run("What is 2 + 2?", backend=backend)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == st["answer"]
    assert msgs[4]["content"] == "You are " + st["reply"]
    assert st.text() == llm.tokenizer.apply_chat_template(msgs, tokenize=False)


def test_the_assistant_turn_opens_like_the_generation_prompt(backend, llm):
    @function
    def opened(s):
        s += user("Hi")
        s += assistant_begin()

    msgs = [{"role": "user", "content": "Hi"}]
    want = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert opened.run(backend=backend).text() == want


def test_streaming_yields_the_gen_text_in_deltas(backend):
    st = chat.run("Tell me a story.", backend=backend, stream=True)
    deltas = list(st.text_iter("answer"))
    assert len(deltas) > 1
    assert "".join(deltas) == st["answer"]
    everything = "".join(st.text_iter())  # ends when the program does
    st.wait()
    assert everything == st.text()
