"""RuntimeEndpoint: run programs against a running streamer server (server/native_api.py).

Every gen is one streamed POST /generate (Server-Sent Events); select's
choices are concurrent POST /generate with input_ids and prompt_logprobs_from;
tokenization and the chat template come from the server (/tokenize,
/apply_chat_template), so the client needs neither the model nor its tokenizer.
Requests go out from one httpx.AsyncClient on this backend's own loop thread,
so concurrent branches and programs share its connection pool.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from streamer.errors import RequestError
from streamer.lang.backend import Backend, LoopThread
from streamer.messages import RequestOutput, SamplingParams
from streamer.sse import DONE, aiter_lines, parse_line


def sampling_json(params: SamplingParams) -> dict[str, Any]:
    sp: dict[str, Any] = {
        "max_tokens": params.max_tokens, "min_tokens": params.min_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "seed": params.seed,
        "stop": params.stop, "stop_token_ids": params.stop_token_ids, "ignore_eos": params.ignore_eos,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty, "skip_special_tokens": params.skip_special_tokens,
    }
    g = params.grammar
    if g is not None:
        if g.kind == "json_object":
            sp["json_object"] = True
        elif g.kind == "choice":
            sp["choices"] = json.loads(g.value)
        else:
            sp[g.kind] = g.value  # regex, json_schema (text), ebnf
    return sp


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx  # noqa: PLC0415 - only this backend needs it

        self.base_url = base_url.rstrip("/")
        self._thread = LoopThread("streamer-lang-http")
        self.loop = self._thread.loop
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)

        async def make() -> Any:
            return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)

        self._client = self._thread.call(make())

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = await self._client.post(path, json=body)
        if r.status_code != 200:
            raise RequestError(_message(r.status_code, r.text))
        return r.json()

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        return (await self._post("/tokenize", {"text": texts}))["input_ids"]

    async def render_chat(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        return (await self._post("/apply_chat_template", {"conversations": conversations}))["texts"]

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        body: dict[str, Any] = {"sampling_params": sampling_json(params), "stream": True,
                                "prompt_logprobs_from": params.prompt_logprobs_from}
        body["text" if isinstance(prompt, str) else "input_ids"] = prompt
        async with self._client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                raise RequestError(_message(r.status_code, (await r.aread()).decode(errors="replace")))
            async for line in aiter_lines(r.aiter_bytes()):
                event = parse_line(line)
                if event is None:
                    continue
                if event == DONE:
                    return
                assert isinstance(event, dict)
                if "error" in event:
                    raise RequestError(event["error"].get("message", "the server failed"))
                m = event["meta_info"]
                yield RequestOutput(m["id"], event["output_ids"], event["text"], finished=event["finished"],
                                    finish_reason=m["finish_reason"], prompt_tokens=m["prompt_tokens"],
                                    completion_tokens=m["completion_tokens"], cached_tokens=m["cached_tokens"],
                                    prompt_logprobs=m.get("prompt_logprobs"))

    def close(self) -> None:
        if self._thread.loop.is_running():
            self._thread.call(self._client.aclose())
            self._thread.stop()


def _message(status: int, text: str) -> str:
    try:
        return f"{status}: {json.loads(text)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {text[:500]}"
