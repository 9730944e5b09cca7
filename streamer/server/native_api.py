"""The native API: POST /generate (text or token ids in, text and token ids out), and the two
helpers the frontend language needs from a remote server, POST /tokenize and POST /apply_chat_template.

  routes(engine) -> [Route]   mount them in any Starlette app whose lifespan starts the engine

POST /generate
  {"text": "..." | ["...", ...]  or  "input_ids": [ids] | [[ids], ...],
   "sampling_params": {"max_tokens": 128, "temperature": 1.0, "top_p", "top_k", "min_p", "seed",
                       "stop": str | [str], "stop_token_ids", "ignore_eos", "min_tokens",
                       "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                       at most one of "regex", "json_schema" (object or text), "json_object": true,
                       "ebnf", "choices": [str]},
   "return_logprob": false, "top_logprobs_num": 0, "prompt_logprobs_from": null, "stream": false}
  -> {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
      "finish_reason", "prompt_logprobs"?, "output_logprobs"? [[logprob, id], ...], "output_top_logprobs"?}}
  A list of prompts answers a list of those (no streaming). stream=true answers Server-Sent
  Events, one `data: {...}` per increment with the *new* text and ids (and meta_info so far;
  "finished": true on the last), then `data: [DONE]`.
  Errors: 400 {"error": {"message", "type", "code"}}; in a stream, a `data: {"error": ...}` event.

POST /tokenize            {"text": str | [str]} -> {"input_ids": [ids] | [[ids], ...]}
                          (as the engine tokenizes a text prompt)
POST /apply_chat_template {"conversations": [[message, ...], ...]} -> {"texts": [str, ...]}
                          (no generation prompt; an empty conversation renders as "")
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from streamer.errors import RequestError
from streamer.messages import GenerateRequest, GrammarSpec, RequestOutput, SamplingParams
from streamer.server.protocol import ApiError
from streamer.sse import encode_data


class NativeSampling(msgspec.Struct, kw_only=True):
    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    ebnf: str | None = None
    choices: list[str] | None = None


class GenerateBody(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    prompt_logprobs_from: int | None = None
    stream: bool = False


class TokenizeBody(msgspec.Struct):
    text: str | list[str]


class ChatTemplateBody(msgspec.Struct):
    conversations: list[list[dict[str, Any]]]


def ok(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def sse(body: Any) -> str:
    return f"data: {encode_data(body)}\n\n"


def error(message: str, status: int = 400, code: str = "invalid_request") -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status)


def grammar_of(sp: NativeSampling) -> GrammarSpec | None:
    specs = []
    if sp.regex is not None:
        specs.append(GrammarSpec("regex", sp.regex))
    if sp.json_schema is not None:
        js = sp.json_schema
        specs.append(GrammarSpec("json_schema", js if isinstance(js, str) else json.dumps(js)))
    if sp.json_object:
        specs.append(GrammarSpec("json_object"))
    if sp.ebnf is not None:
        specs.append(GrammarSpec("ebnf", sp.ebnf))
    if sp.choices is not None:
        if not sp.choices:
            raise RequestError("choices needs at least one choice")
        specs.append(GrammarSpec("choice", json.dumps(sp.choices)))
    if len(specs) > 1:
        raise RequestError("give at most one of regex, json_schema, json_object, ebnf, choices")
    return specs[0] if specs else None


def sampling_params(body: GenerateBody) -> SamplingParams:
    sp = body.sampling_params
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    params = SamplingParams(
        max_tokens=sp.max_tokens, min_tokens=sp.min_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=sp.top_k, min_p=sp.min_p, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty, seed=sp.seed,
        stop=stop, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens, grammar=grammar_of(sp),
        logprobs=body.top_logprobs_num if body.return_logprob else None,
        prompt_logprobs_from=body.prompt_logprobs_from,
    )
    if params.prompt_logprobs_from is not None and params.prompt_logprobs_from < 1:
        raise RequestError(f"prompt_logprobs_from must be >= 1, got {params.prompt_logprobs_from}")
    params.validate()
    return params


def prompts(body: GenerateBody) -> tuple[list[str | list[int]], bool]:
    """(prompts, whether the body was a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("give exactly one of text or input_ids")
    if body.text is not None:
        if isinstance(body.text, str):
            return [body.text], False
        if not body.text:
            raise RequestError("text must not be an empty list")
        return list(body.text), True
    ids = body.input_ids or []
    if not ids:
        raise RequestError("input_ids must not be empty")
    batch = isinstance(ids[0], list)
    rows = ids if batch else [ids]
    if not all(isinstance(r, list) and r and all(isinstance(t, int) for t in r) for r in rows):
        raise RequestError("input_ids must be a list of token ids or a list of such lists")
    return [list(r) for r in rows], batch


def meta_info(out: RequestOutput, body: GenerateBody) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.request_id, "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens, "finish_reason": out.finish_reason,
    }
    if body.prompt_logprobs_from is not None:
        meta["prompt_logprobs"] = out.prompt_logprobs or []
    if body.return_logprob:
        lps = out.logprobs or []
        meta["output_logprobs"] = [[t.logprob, t.token_id] for t in lps]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, tid] for tid, lp in (t.top_logprobs or [])] for t in lps]
    return meta


class InFlight:
    """Under the app of server/app.py, requests count as in flight until done() (a shutdown aborts them)."""

    def __init__(self, state: Any, reqs: list[GenerateRequest]) -> None:
        self.state, self.ids = state, {r.request_id for r in reqs}
        if state is not None:
            state.inflight.update(self.ids)

    def done(self) -> None:
        if self.state is not None:
            self.state.inflight.difference_update(self.ids)


def routes(engine: Any) -> list[Route]:
    """The native routes over `engine` (an AsyncEngine). Mounted in server/app.py's app, they
    also go through its admission (503 while draining or when the queue is full) and its
    in-flight tracking; in a bare Starlette app they talk to the engine directly."""

    def request(prompt: str | list[int], params: SamplingParams) -> GenerateRequest:
        rid = engine.new_request_id()
        if isinstance(prompt, str):
            return GenerateRequest(request_id=rid, prompt=prompt, params=params)
        return GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)

    async def generate(req: Request) -> Response:
        try:
            body = msgspec.json.decode(await req.body(), type=GenerateBody)
            batch, is_batch = prompts(body)
            params = sampling_params(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RequestError) as e:
            return error(str(e))
        state = getattr(req.app.state, "server", None)
        try:
            if state is not None:
                state.admit(len(batch))
            elif engine.dead:
                raise ApiError(f"the engine is down: {engine.dead}", 503, code="unavailable")
        except ApiError as e:
            return error(e.message, e.status, e.code or "unavailable")
        if body.stream:
            if is_batch:
                return error("stream needs a single prompt")
            return await stream(request(batch[0], params), body, state)
        reqs = [request(p, params) for p in batch]
        flight = InFlight(state, reqs)
        try:
            outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            flight.done()
        failed = next((o for o in outs if o.error is not None), None)
        if failed is not None:
            return error(failed.error or "", 400)
        results = [{"text": o.text, "output_ids": o.token_ids, "meta_info": meta_info(o, body)} for o in outs]
        return ok(results if is_batch else results[0])

    async def stream(r: GenerateRequest, body: GenerateBody, state: Any) -> Response:
        flight = InFlight(state, [r])
        outputs = engine.submit(r)
        try:
            first = await anext(outputs)  # a refused request must still become a 400
        except BaseException:
            flight.done()
            raise
        if first.error is not None:
            await outputs.aclose()
            flight.done()
            return error(first.error)

        async def events() -> AsyncIterator[str]:
            out: RequestOutput | None = first
            prompt_logprobs = first.prompt_logprobs
            try:
                while out is not None:
                    if out.prompt_logprobs is not None:
                        prompt_logprobs = out.prompt_logprobs
                    if out.error is not None:
                        yield sse({"error": {"message": out.error, "type": "server_error", "code": "engine_error"}})
                        break
                    meta = meta_info(msgspec.structs.replace(out, prompt_logprobs=prompt_logprobs), body)
                    event = {"text": out.text, "output_ids": out.token_ids, "meta_info": meta,
                             "finished": out.finished}
                    yield sse(event)
                    out = None if out.finished else await anext(outputs, None)
                yield "data: [DONE]\n\n"
            finally:
                await outputs.aclose()  # the client went away: the engine aborts the request
                flight.done()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def tokenize(req: Request) -> Response:
        try:
            body = msgspec.json.decode(await req.body(), type=TokenizeBody)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return error(str(e))
        if engine.hf_tokenizer is None:
            return error("this model has no tokenizer")
        texts = [body.text] if isinstance(body.text, str) else body.text
        ids = await asyncio.to_thread(lambda: engine.hf_tokenizer(texts, add_special_tokens=True)["input_ids"])
        ids = [list(x) for x in ids]
        return ok({"input_ids": ids[0] if isinstance(body.text, str) else ids})

    async def apply_chat_template(req: Request) -> Response:
        try:
            body = msgspec.json.decode(await req.body(), type=ChatTemplateBody)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return error(str(e))
        hf = engine.hf_tokenizer
        if hf is None:
            return error("this model has no tokenizer")
        try:
            texts = [hf.apply_chat_template(c, tokenize=False) if c else "" for c in body.conversations]
        except Exception as e:  # noqa: BLE001 - template errors come from the messages
            return error(f"cannot apply the chat template: {e}")
        return ok({"texts": texts})

    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/apply_chat_template", apply_chat_template, methods=["POST"]),
    ]
