"""Chat prompts with tools: through the model's template where it reads tools, rewritten
in the hermes format where it does not; nothing the client sent is dropped."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from streamer.chat_template import (
    check_kwargs,
    hermes_messages,
    render,
    renders_tools,
    tool_format,
    with_reasoning_effort,
)
from streamer.errors import RequestError

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
]


@pytest.fixture(scope="module")
def qwen3_tok(qwen3_model):
    return AutoTokenizer.from_pretrained(str(qwen3_model))


@pytest.fixture(scope="module")
def smol_tok(default_model):
    return AutoTokenizer.from_pretrained(str(default_model))


def test_a_template_that_reads_tools_renders_them_itself(qwen3_tok):
    assert renders_tools(qwen3_tok.chat_template) and tool_format(qwen3_tok) == "hermes"
    ids = render(qwen3_tok, HISTORY, tools=TOOLS)
    # exactly what transformers renders, arguments given as the objects templates expect
    as_objects = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                      for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in HISTORY]
    want = qwen3_tok.apply_chat_template(as_objects, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    text = qwen3_tok.decode(ids)
    assert '"name": "get_weather"' in text and "<tool_response>\n24 C\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text


def test_chat_template_kwargs_reach_the_template(qwen3_tok):
    on = qwen3_tok.decode(render(qwen3_tok, HISTORY[:2]))
    off = qwen3_tok.decode(render(qwen3_tok, HISTORY[:2], kwargs={"enable_thinking": False}))
    assert off == on + "<think>\n\n</think>\n\n"


EFFORT_TEMPLATE = ("{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                   "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_reasoning_effort_is_the_template_variable_of_that_name(smol_tok, monkeypatch):
    """OpenAI's reasoning_effort reaches a template that reads it (gpt-oss's) as its variable;
    it is refused where the template has none (naming Qwen3's switch where it has that), where
    its value is not low, medium or high, and where chat_template_kwargs say otherwise."""
    kwargs = with_reasoning_effort(EFFORT_TEMPLATE, "high", {"x": 1})
    assert kwargs == {"x": 1, "reasoning_effort": "high"}
    assert with_reasoning_effort(EFFORT_TEMPLATE, None, {"x": 1}) == {"x": 1}
    assert with_reasoning_effort(EFFORT_TEMPLATE, "low", {"reasoning_effort": "low"}) == {"reasoning_effort": "low"}
    monkeypatch.setattr(smol_tok, "chat_template", EFFORT_TEMPLATE)
    assert smol_tok.decode(render(smol_tok, HISTORY[:2], kwargs=kwargs)).startswith("Reasoning: high\nsystem: ")
    with pytest.raises(RequestError, match="must be one of low, medium, high, got 'minimal'"):
        with_reasoning_effort(EFFORT_TEMPLATE, "minimal", {})
    with pytest.raises(RequestError, match="'high' and chat_template_kwargs' reasoning_effort 'low' disagree"):
        with_reasoning_effort(EFFORT_TEMPLATE, "high", {"reasoning_effort": "low"})
    with pytest.raises(RequestError, match="reads no reasoning_effort$"):
        with_reasoning_effort("{{ messages }}", "low", {})
    qwen3_like = "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{%- endif %}"
    with pytest.raises(RequestError, match='chat_template_kwargs {"enable_thinking": false}'):
        with_reasoning_effort(qwen3_like, "low", {})


DOCS_TEMPLATE = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_documents_reach_a_template_that_reads_them(smol_tok, monkeypatch):
    """vLLM's documents: the template's own variable (retrieval-augmented templates); refused
    where the template would drop them, and where a document is not an object of strings."""
    docs = [{"title": "Paris", "text": "The capital of France."}, {"title": "Rome", "text": "Of Italy."}]
    with pytest.raises(RequestError, match="does not read documents: put them in the messages"):
        render(smol_tok, HISTORY[:2], documents=docs)
    monkeypatch.setattr(smol_tok, "chat_template", DOCS_TEMPLATE)
    text = smol_tok.decode(render(smol_tok, HISTORY[:2], documents=docs))
    assert text.startswith("[Paris] The capital of France.\n[Rome] Of Italy.\nsystem: Be brief.\n")
    with pytest.raises(RequestError, match="each document must be an object of strings"):
        render(smol_tok, HISTORY[:2], documents=[{"title": "Paris", "year": 1}])  # type: ignore[dict-item]


def test_a_request_template_renders_in_place_of_the_models(smol_tok):
    own = render(smol_tok, HISTORY[:2], chat_template="{% for m in messages %}<{{ m.role }}>{% endfor %}")
    assert smol_tok.decode(own) == "<system><user>"
    with pytest.raises(RequestError, match="cannot apply the chat template"):
        render(smol_tok, HISTORY[:2], chat_template="{% for m in messages %}")


def test_a_template_without_tools_gets_them_in_the_hermes_format(smol_tok):
    assert not renders_tools(smol_tok.chat_template) and tool_format(smol_tok) == "hermes"
    text = smol_tok.decode(render(smol_tok, HISTORY, tools=TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text  # every signature, whole
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n24 C\n</tool_response>" in text


def test_the_hermes_rewriting_keeps_plain_messages_and_drops_reasoning():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "r"}]
    assert hermes_messages(msgs, None) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert hermes_messages([{"role": "user", "content": "hi"}], TOOLS)[0]["role"] == "system"


def test_reserved_template_arguments_are_refused():
    with pytest.raises(RequestError, match="may not set add_generation_prompt, messages"):
        check_kwargs({"messages": [], "add_generation_prompt": False, "enable_thinking": True})
    assert check_kwargs({"enable_thinking": False}) == {"enable_thinking": False}


def test_a_template_error_is_the_requests_error(smol_tok):
    with pytest.raises(RequestError, match="cannot apply the chat template"):
        render(smol_tok, [{"role": "user"}, {"role": "assistant", "content": 3}])


def test_a_chat_template_file_replaces_the_models(default_model, tmp_path):
    from streamer.engine.tokenizer import load_tokenizer
    from streamer.errors import ModelLoadError

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tok = load_tokenizer(default_model, str(f))
    assert tok.decode(render(tok, [{"role": "user", "content": "hi"}])) == "[user] hi\n"
    with pytest.raises(ModelLoadError, match="--chat-template .*missing.jinja: cannot read it"):
        load_tokenizer(default_model, str(tmp_path / "missing.jinja"))


def test_default_template_kwargs_are_checked_at_start():
    from streamer.config import EngineConfig
    from streamer.errors import ConfigError

    with pytest.raises(ConfigError, match="default_chat_template_kwargs may not set tokenize"):
        EngineConfig(default_chat_template_kwargs={"tokenize": False})
    assert EngineConfig(default_chat_template_kwargs={"enable_thinking": False}).default_chat_template_kwargs


def test_the_tokenizer_actor_applies_the_defaults_under_the_requests_own(qwen3_tok):
    from streamer.engine.tokenizer import Tokenizer
    from streamer.messages import GenerateRequest

    actor = Tokenizer(qwen3_tok, [151645], 4096, 151936)
    actor.chat_template_kwargs = {"enable_thinking": False}
    ask = [{"role": "user", "content": "hi"}]
    off = actor.encode_prompt(GenerateRequest(request_id="a", messages=ask))
    on = actor.encode_prompt(GenerateRequest(request_id="b", messages=ask, chat_template_kwargs={"enable_thinking": True}))
    assert qwen3_tok.decode(off).endswith("<think>\n\n</think>\n\n") and off[:len(on)] == on and len(off) > len(on)
    with_tools = actor.encode_prompt(GenerateRequest(request_id="c", messages=ask, tools=TOOLS))
    assert "get_weather" in qwen3_tok.decode(with_tools)
    with pytest.raises(RequestError, match="need messages"):
        actor.encode_prompt(GenerateRequest(request_id="d", prompt="hi", tools=TOOLS))


def test_continue_final_message_leaves_the_assistants_message_open(smol_tok):
    """vLLM's continue_final_message: the prompt ends with the assistant's words, not its
    end of turn, so the answer goes on from them."""
    from streamer.chat_template import render

    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    text = smol_tok.decode(render(smol_tok, msgs, add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("The colour is")
    closed = smol_tok.decode(render(smol_tok, msgs, add_generation_prompt=False))
    assert closed.startswith(text) and len(closed) > len(text)

    from streamer.engine.tokenizer import Tokenizer
    from streamer.messages import GenerateRequest

    actor = Tokenizer(smol_tok, [2], 4096, len(smol_tok))
    ids = actor.encode_prompt(GenerateRequest(request_id="a", messages=msgs, add_generation_prompt=False,
                                              continue_final_message=True))
    assert smol_tok.decode(ids) == text
