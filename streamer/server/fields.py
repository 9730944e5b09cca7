"""What this server does with each field of OpenAI's completions and chat completions bodies.

Nothing OpenAI's API defines is silently ignored: a field is implemented (a field of the
request Structs in protocol.py), accepted because it has no effect on one server
(ACCEPTED below says why, one by one), or refused with a 400 whose `param` is its name
(REFUSED, checked here after decoding). Checks that involve two fields (best_of and n,
echo and logprobs, top_logprobs without logprobs, stream_options without stream) are in
the endpoints' own checks (openai_api.py).

Other servers' extensions (OTHER_SERVERS_REFUSED) follow the same rule where they would change
the answer; vLLM's include_stop_str_in_output, continue_final_message, bad_words and (completions
and chat completions: SERVED_BY_COMPLETIONS) prompt_logprobs and return_tokens_as_token_ids are
implemented, and so are SGLang's regex, ebnf, json_schema and no_stop_trim (its names for guided_regex,
guided_grammar, guided_json and include_stop_str_in_output).
The refused fields are not Struct fields: they would appear in the OpenAPI document as
if they worked. They are read from a second, shallow decode of the body (its top-level
keys, values left undecoded), and only when one of their names occurs in the body's bytes
at all, so that the usual body costs one substring search per name.

tools, tool_choice, parallel_tool_calls, chat_template_kwargs and the messages' tool_calls,
tool_call_id and reasoning_content are implemented (protocol.py, chat_output.py); so is
prediction (Predicted Outputs: the proposals of ngram speculation follow it, spec/ngram.py,
and the usage counts its tokens the answer kept; the answer is the same either way).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from streamer.server.protocol import ApiError

Rule = Callable[[Any], str | None]
"""A refused field's check: its value (decoded JSON; null counts as absent and is never
checked) -> why the value is refused, or None when it is accepted."""


def unsupported(why: str) -> Rule:
    return lambda value: why


def only(allowed: tuple[Any, ...], why: str) -> Rule:
    """Accepted when the value is one of `allowed` (the values that ask for nothing this
    server does not do: OpenAI's defaults, mostly)."""
    return lambda value: None if any(value == a and type(value) is type(a) for a in allowed) else why


DEPRECATED_FUNCTIONS = "is deprecated and not supported: use tools and tool_choice"
SAMPLING_ONLY = "{} is supported by /v1/completions, /v1/chat/completions and WebSocket turns only"

OTHER_SERVERS_REFUSED: dict[str, Rule] = {
    # vLLM's extensions
    "use_beam_search": only((False,), "use_beam_search: beam search is not supported"),
    "length_penalty": only((1.0, 1), "length_penalty (a beam-search setting) is not supported"),
    "bad_words": only(([],), SAMPLING_ONLY.format("bad_words")),
    "prompt_logprobs": unsupported("prompt_logprobs is supported by /v1/completions and /v1/chat/completions only"),
    "guided_decoding_backend": only(("xgrammar", "auto"), "guided_decoding_backend: the one backend is xgrammar"),
    "guided_whitespace_pattern": unsupported("guided_whitespace_pattern is not supported"),
    "structural_tag": unsupported('structural_tag at the top level is not supported: use response_format '
                                  '{"type": "structural_tag", ...}'),
    "spaces_between_special_tokens": only((True,), "spaces_between_special_tokens may only be true (the "
                                                   "tokenizer's own decoding)"),
    "return_tokens_as_token_ids": only((False,), "return_tokens_as_token_ids is supported by /v1/completions and "
                                                 "/v1/chat/completions only"),
    "prompt_embeds": unsupported("prompt_embeds is not supported: send text or token ids"),
    "vllm_xargs": unsupported("vllm_xargs is not supported"),
    "kv_transfer_params": unsupported("kv_transfer_params (disaggregated prefill) is not supported"),
    "mm_processor_kwargs": unsupported("mm_processor_kwargs: this server serves text models"),
    # SGLang's
    "lora_path": unsupported("lora_path is not supported: name a LoRA adapter (--lora-modules NAME=PATH) as the "
                             "request's model"),
    "no_stop_trim": only((False,), SAMPLING_ONLY.format("no_stop_trim")),
    "regex": unsupported(SAMPLING_ONLY.format("regex")),
    "ebnf": unsupported(SAMPLING_ONLY.format("ebnf")),
    "json_schema": unsupported(SAMPLING_ONLY.format("json_schema at the top level")),
    "custom_logit_processor": unsupported("custom_logit_processor is not supported"),
    "return_hidden_states": only((False,), "return_hidden_states is not supported"),
    "session_params": unsupported("session_params is not supported: WebSocket chat sessions keep a "
                                  "conversation's KV (/v1/chat/ws)"),
}
"""Other servers' extensions that would change the answer: refused unless they ask for what
this server does anyway (their default), so that a request written for vLLM or SGLang never
gets another answer than it asked for. Their other extensions (request ids, hints) pass."""

SERVED_BY_SAMPLING_FIELDS = ("bad_words", "no_stop_trim", "regex", "ebnf", "json_schema")
"""Other servers' extensions that protocol.SamplingFields implements: completions, chat completions
and WebSocket turns take them; refused elsewhere (Responses, embeddings, score)."""
SERVED_BY_COMPLETIONS = (*SERVED_BY_SAMPLING_FIELDS, "prompt_logprobs", "return_tokens_as_token_ids")
"""And those that completions and chat completions alone implement (not WebSocket turns)."""

_OTHERS_BUT_SERVED = {k: v for k, v in OTHER_SERVERS_REFUSED.items() if k not in SERVED_BY_COMPLETIONS}
WEBSOCKET_REFUSED = {k: v for k, v in OTHER_SERVERS_REFUSED.items() if k not in SERVED_BY_SAMPLING_FIELDS}

COMPLETION_REFUSED: dict[str, Rule] = {
    "suffix": only(("",), "suffix (text that follows the completion: insertion) is not supported"),
    **_OTHERS_BUT_SERVED,
}
"""(best_of is checked with n by the endpoint: it is accepted when it asks for n samples.)"""

CHAT_REFUSED: dict[str, Rule] = {
    "audio": unsupported("audio (audio output) is not supported: this server answers text"),
    "modalities": only((["text"],), 'only text output is supported: modalities may only be ["text"]'),
    "store": only((False,), "this server stores no completions: store may only be false"),
    "service_tier": only(("auto", "default"), "this server has one service tier: service_tier may be "
                                              "auto or default"),
    "web_search_options": unsupported("web_search_options (web search) is not supported"),
    "verbosity": only(("medium",), "verbosity is not supported: it may only be medium (the default)"),
    "functions": unsupported(f"functions {DEPRECATED_FUNCTIONS}"),
    "function_call": unsupported(f"function_call {DEPRECATED_FUNCTIONS}"),
    # vLLM's chat extensions
    "echo": only((False,), "echo is not supported in chat completions (completions have it)"),
    **_OTHERS_BUT_SERVED,
}

RESPONSES_REFUSED: dict[str, Rule] = {
    "conversation": unsupported("conversation (a stored Conversations object) is not supported: continue a "
                                "response with previous_response_id, or send the whole conversation in input"),
    "prompt": unsupported("prompt (a stored prompt template) is not supported: send input and instructions"),
    "truncation": only(("disabled",), "truncation may only be disabled: an input longer than the context is "
                                      "refused, never cut"),
    "max_tool_calls": unsupported("max_tool_calls is not supported: parallel_tool_calls false allows one call"),
    "service_tier": CHAT_REFUSED["service_tier"],
    "n": only((1,), "n is not a Responses field: a response has one output (chat completions have n)"),
    "max_tokens": unsupported("max_tokens is not a Responses field: use max_output_tokens"),
    "response_format": unsupported("response_format is not a Responses field: use text.format"),
    **OTHER_SERVERS_REFUSED,
}
"""/v1/responses: what it refuses. Function tools, text.format and include's values are checked by
the endpoint (responses_api.py)."""

MESSAGE_REFUSED: dict[str, Rule] = {
    "function_call": unsupported("function_call is deprecated and not supported: use tool_calls"),
    "audio": unsupported("audio (a previous audio response) is not supported: this server answers text"),
}
"""Fields of a chat message, checked in every message (param: messages[i].field)."""

ACCEPTED: Mapping[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; one server has none",
    "safety_identifier": "user's successor: the same",
    "prompt_cache_key": "a routing hint for OpenAI's caches across machines; here the prefix cache is "
                        "automatic, and cache_salt is what namespaces it",
    "metadata": "tags of a stored completion; nothing is stored (store may only be false)",
    "stream_options.include_obfuscation": "padding that hides token lengths on OpenAI's shared service; "
                                          "no padding is sent",
    "store": "false: nothing is stored (true is refused)",
    "service_tier": '"auto" or "default": there is one tier (others are refused)',
    "modalities": '["text"]: what this server answers (others are refused)',
    "verbosity": '"medium": the default (others are refused)',
    "best_of": "1, or equal to n: n samples, all returned (others are refused)",
}
"""The OpenAI fields accepted without an effect, and why none is needed (documentation, and
the specification tests/server/test_api_fields.py checks). /v1/responses accepts those of
them it has (user, safety_identifier, prompt_cache_key, metadata: echoed in the response,
stream_options.include_obfuscation) for the same reasons."""


def check_refused(data: bytes, rules: Mapping[str, Rule], message_rules: Mapping[str, Rule] | None = None) -> None:
    """Refuse (400, param: the field) a body that gives a refused field a value other than null
    or one its rule accepts. `data` decoded into its Struct already, so it is valid JSON."""
    names = [*rules, *(message_rules or ())]
    if not any(b'"' + n.encode() + b'"' in data for n in names):
        return
    try:
        raw = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
        check(raw, rules, "")
        if message_rules and "messages" in raw:
            messages = msgspec.json.decode(raw["messages"], type=list[dict[str, msgspec.Raw]])
            for i, m in enumerate(messages):
                check(m, message_rules, f"messages[{i}].")
    except RecursionError:  # (decode_body refuses such a body first; this is for the value alone)
        raise ApiError("the body nests too deeply") from None


def check(raw: Mapping[str, msgspec.Raw], rules: Mapping[str, Rule], prefix: str) -> None:
    for name, rule in rules.items():
        if name not in raw:
            continue
        value = msgspec.json.decode(raw[name])
        why = None if value is None else rule(value)
        if why is not None:
            raise ApiError(why, param=prefix + name, code="unsupported_parameter")
