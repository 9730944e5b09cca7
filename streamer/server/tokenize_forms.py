"""POST /tokenize's body (server/native_api.py): this server's form, {"text"}, and vLLM's two,
{"prompt"} and {"messages"} (`vllm_tokenize`), so that a vLLM client counts tokens here as there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from streamer.chat_template import check_kwargs, render
from streamer.errors import RequestError
from streamer.server.openai_api import chat_messages
from streamer.server.protocol import ApiError, ChatMessage, Tool
from streamer.server.state import ServerState


class TokenizeBody(msgspec.Struct, kw_only=True):
    """One of text (this server's form), prompt or messages (vLLM's)."""

    text: str | list[str] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    add_special_tokens: bool | None = None
    """vLLM's prompt form: the tokenizer's special tokens (BOS) added; default true."""
    add_generation_prompt: bool | None = None
    """vLLM's chat form (default true), as in chat completions."""
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


async def vllm_tokenize(st: ServerState, body: TokenizeBody, hf: Any,
                        off_loop: Callable[[Callable[[], Any]], Awaitable[Any]]) -> dict[str, Any]:
    """vLLM's /tokenize: a prompt as the engine tokenizes it, or messages as it renders them
    (the server's template variables under the request's); hf: the tokenizer, off_loop: runs a
    function in native_api's thread pool."""
    chat_only = [f for f in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
                 if getattr(body, f) is not None]
    if body.prompt is not None and chat_only:
        raise ApiError(f"{chat_only[0]} goes with messages, not with prompt", param=chat_only[0])
    add_generation_prompt = body.add_generation_prompt is not False
    continue_final_message = bool(body.continue_final_message)
    if body.prompt is not None:
        st.limits.prompts([body.prompt], "prompt")
        add = body.add_special_tokens is not False
        ids = await off_loop(lambda: list(hf(body.prompt, add_special_tokens=add)["input_ids"]))
    else:
        assert body.messages is not None
        if body.add_special_tokens:
            raise ApiError("add_special_tokens with messages is not supported: the chat template writes the "
                           "special tokens", param="add_special_tokens")
        if continue_final_message and add_generation_prompt:
            raise ApiError("continue_final_message continues the last message: it needs add_generation_prompt: "
                           "false", param="continue_final_message")
        msgs = chat_messages(body.messages)
        st.limits.at_most(st.limits.messages(msgs), "max_prompt_chars", "characters of message content",
                           "messages")
        try:
            kwargs = {**st.info.chat_template_kwargs, **check_kwargs(body.chat_template_kwargs)}
        except RequestError as e:
            raise ApiError(str(e), param="chat_template_kwargs") from None
        tools = msgspec.to_builtins(body.tools) if body.tools else None
        try:
            ids = await off_loop(lambda: render(hf, msgs, tools=tools, kwargs=kwargs,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message))
        except RequestError as e:
            raise ApiError(str(e), param="messages") from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": st.info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = hf.convert_ids_to_tokens(ids)
    return out
