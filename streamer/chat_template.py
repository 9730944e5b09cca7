"""Chat messages (with tools) -> the model's prompt, through its chat template.

The engine's tokenizer actor renders every chat prompt here; the server only asks which
tool-call markup the template speaks (`tool_format`) and checks what a request brings
(`check_kwargs`). Tool definitions reach the model through the template
(`apply_chat_template(..., tools=...)`), as do assistant `tool_calls` and `tool` results.

A template that never reads `tools` (SmolLM2's, say) would drop them silently. For such a
template the messages are rewritten first, in the hermes format the model can be asked
to follow (and that the hermes parser and grammar expect): the tool signatures appended
to the system message, each assistant call written as `<tool_call>` markup in its content,
tool results as a user turn of `<tool_response>` blocks. Nothing the client sent is lost.
DeepSeek's own templates (V3's, V3.1's) are the exception: they render calls and results in
DeepSeek's markup but never read `tools`, so only the tool signatures are written, into the
system message in the layout of DeepSeek's model cards (`deepseek_messages`), and the model
is asked for its own markup (deepseek_v3 / deepseek_v31).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from streamer.errors import RequestError

HARMONY_CHANNEL = "<|channel|>"
"""The marker by which a template speaks gpt-oss's harmony format (server/harmony.py reads
those messages; it imports this, as the server may import this module and not the reverse)."""

DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>")
"""DeepSeek's tool-call markers: calls begin and end, one call's begin and end, the separator
after its header (U+FF5C fullwidth bars, U+2581 where a space would be). Special tokens of
DeepSeek's tokenizers; server/tool_parsers_deepseek.py reads them."""

RESERVED_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs",
})
"""apply_chat_template's own arguments: chat_template_kwargs may not set them."""


def check_kwargs(kwargs: Mapping[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's (or the server's default) template variables; RequestError naming a
    reserved one (it would override the messages, the tools or the tokenization)."""
    if not kwargs:
        return {}
    bad = sorted(k for k in kwargs if k in RESERVED_KWARGS)
    if bad:
        raise RequestError(f"{param} may not set {', '.join(bad)} (arguments of the template call itself)")
    return dict(kwargs)


def template_text(hf_tokenizer: Any) -> str:
    """The template the tokenizer applies to tool requests ("" when it has none)."""
    t = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: the tool one where there is one
        t = t.get("tool_use") or t.get("default") or next(iter(t.values()), None)
    return t or ""


@functools.lru_cache(maxsize=16)
def reads(template: str, variable: str) -> bool:
    """True if the template reads `variable` (a template that does not parse: if it names it)."""
    import jinja2
    import jinja2.meta

    try:
        return variable in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return variable in template


def check_documents(template: str, documents: list[dict[str, str]]) -> None:
    """RequestError unless the template reads `documents` (a template that does not would drop
    them silently) and each document is an object of strings."""
    if not reads(template, "documents"):
        raise RequestError("this model's chat template does not read documents: put them in the messages")
    if not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
        raise RequestError("each document must be an object of strings (e.g. title and text)")


def renders_tools(template: str) -> bool:
    """True if the template reads the `tools` variable."""
    return reads(template, "tools")


REASONING_EFFORTS = ("low", "medium", "high")
"""reasoning_effort's values (vLLM's, the harmony format's: gpt-oss)."""


def with_reasoning_effort(template: str, effort: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's own template variables (its chat_template_kwargs) with its reasoning_effort
    (OpenAI's field), which the template reads as the variable of that name (gpt-oss's:
    "Reasoning: high" in its system message; over the server's default variables); RequestError
    where the value is not one of REASONING_EFFORTS, where the template has no such variable
    (the field would change nothing), or where the request's chat_template_kwargs set another."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise RequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    if not reads(template, "reasoning_effort"):
        hint = (' (its reasoning is turned off with chat_template_kwargs {"enable_thinking": false})'
                if reads(template, "enable_thinking") else "")
        raise RequestError("reasoning_effort is not supported by this model: its chat template reads no "
                           f"reasoning_effort{hint}")
    if kwargs.get("reasoning_effort", effort) != effort:
        raise RequestError(f"reasoning_effort {effort!r} and chat_template_kwargs' reasoning_effort "
                           f"{kwargs['reasoning_effort']!r} disagree")
    return {**kwargs, "reasoning_effort": effort}


def markup_format(text: str) -> str | None:
    """The tool-call markup a template's text writes, by the markers it contains (None: none
    streamer knows). DeepSeek's: deepseek_v3 where the call is a fenced ```json block after
    `function<｜tool▁sep｜>NAME` (V3, V3-0324, R1-0528), else deepseek_v31 (V3.1 and later:
    NAME right after the call's begin marker, the JSON after the separator, unfenced)."""
    if HARMONY_CHANNEL in text:
        return "openai"
    _, _, call_begin, _, sep = DEEPSEEK_MARKERS
    if call_begin in text and sep in text:
        return "deepseek_v3" if "```json" in text else "deepseek_v31"
    if "<function=" in text and "<parameter=" in text:  # (Qwen3-Coder's XML calls, inside <tool_call>)
        return "qwen3_coder"
    if "<arg_key>" in text:  # (GLM-4.5's: <tool_call>NAME then <arg_key>/<arg_value> pairs)
        return "glm45"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3_json"
    return None


def tool_format(hf_tokenizer: Any) -> str | None:
    """The tool-call markup the model is told to write: openai for a harmony template (one
    that writes `<|channel|>`: gpt-oss), a deepseek format for one that writes DeepSeek's
    markers (reading tools or not: see deepseek_messages), else from the template where it
    renders tools (markup_format; None when no known markup shows: the server then needs
    --tool-call-parser), else hermes (the rewriting of this module). `render` decides by
    the same markup_format, so the prompt and the parser cannot disagree."""
    text = template_text(hf_tokenizer)
    fmt = markup_format(text)
    if fmt in ("openai", "deepseek_v3", "deepseek_v31"):  # (their messages or markup, whatever the template)
        return fmt
    if not renders_tools(text):
        return "hermes"
    return fmt


def _arguments(call: Mapping[str, Any]) -> Any:
    """A call's arguments as the template expects them: OpenAI sends a JSON string, most
    templates `tojson` a mapping (a string that is not a JSON object stays a string)."""
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args if args is not None else {}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls' arguments decoded for the template; everything else as sent."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m)
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}} if "function" in c
                else c for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def hermes_call(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that does not read tools: see the module docstring."""
    out: list[dict[str, Any]] = []
    if tools:
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = ("# Tools\n\nYou may call the functions whose JSON signatures follow.\n<tools>\n" + sigs
                + "\n</tools>\n\nTo call one, answer with its name and arguments in tool_call tags:\n"
                + '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0])
            first["content"] = (first.get("content") or "") + "\n\n" + text
            out.append(first)
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": text})
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [hermes_call(c["function"]["name"], _arguments(c["function"])) for c in m["tool_calls"]]
            content = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    for m in out:
        m.pop("_tool_results", None)
        if m.get("content") is None:
            m["content"] = ""
    return out


def deepseek_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      fmt: str) -> list[dict[str, Any]]:
    """Messages for a DeepSeek template that does not read tools: the signatures appended to
    the system message under "## Tools" (a "### NAME" section each, with its description and
    parameters), then the call format of fmt. Calls and results stay as sent: the template
    writes them in its markup (and concatenates the arguments as the client's string)."""
    if not tools:
        return list(messages)
    calls_begin, calls_end, call_begin, call_end, sep = DEEPSEEK_MARKERS
    sections = []
    for t in tools:
        fn = t.get("function") or {}
        sections.append(f"### {fn.get('name')}\nDescription: {fn.get('description') or ''}\n\n"
                        f"Parameters: {json.dumps(fn.get('parameters', {'type': 'object'}), ensure_ascii=False)}")
    if fmt == "deepseek_v3":
        call = f"{call_begin}function{sep}<tool name>\n```json\n<arguments as a JSON object>\n```{call_end}"
        joined = "one per line"
    else:
        call = f"{call_begin}<tool name>{sep}<arguments as a JSON object>{call_end}"
        joined = "with nothing between them"
    text = ("## Tools\nYou have access to the following tools:\n\n" + "\n\n".join(sections)
            + f"\n\nTo use tools, answer in exactly this format:\n{calls_begin}{call}{calls_end}\n\n"
            "The tool name must be one of the tools above, and the arguments valid JSON following its "
            f"Parameters schema. Several calls go in one {calls_begin} ... {calls_end} block, {joined}.")
    out = list(messages)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def render(hf_tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
           kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
           chat_template: str | None = None) -> list[int]:
    """The prompt's token ids; RequestError when the template refuses these messages.
    continue_final_message: the last (assistant) message is left open for the answer to
    continue (transformers cuts the rendered text after its content). documents: for a template
    that reads them (`check_documents`). chat_template: renders in place of the model's."""
    extra = check_kwargs(kwargs)
    text = template_text(hf_tokenizer) if chat_template is None else chat_template
    if chat_template is not None:
        extra["chat_template"] = chat_template
    if documents is not None:
        check_documents(text, documents)
        extra["documents"] = documents
    decoded = renders_tools(text)
    fmt = markup_format(text)
    if decoded:
        msgs, call_tools = template_messages(messages), tools or None
    elif fmt in ("deepseek_v3", "deepseek_v31"):
        msgs, call_tools = deepseek_messages(messages, tools, fmt), None
    else:
        msgs, call_tools = hermes_messages(messages, tools), None

    def apply(msgs: list[dict[str, Any]]) -> Any:
        return hf_tokenizer.apply_chat_template(msgs, tools=call_tools, tokenize=True,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, **extra)

    try:
        try:
            ids = apply(msgs)
        except TypeError:
            # a template that concatenates a call's arguments as text (DeepSeek-V3.1's:
            # `name + '<｜tool▁sep｜>' + arguments`) gets them as the client sent them
            if not decoded or msgs == messages:
                raise
            ids = apply(messages)
    except Exception as e:  # noqa: BLE001 - template errors come from user messages
        raise RequestError(f"cannot apply the chat template to these messages: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
