"""The native API: POST /generate (text or token ids in, text and token ids out), the two
helpers the frontend language needs from a remote server, POST /tokenize and POST
/apply_chat_template, and POST /detokenize and GET /version.

  routes() -> [Route]   for server/app.py's app (its ServerState is request.app.state.server)

POST /generate
  {"text": "..." | ["...", ...]  or  "input_ids": [ids] | [[ids], ...],
   "sampling_params": {"max_tokens": 128, "temperature": 1.0, "top_p", "top_k", "min_p", "seed",
                       "stop": str | [str], "stop_token_ids", "ignore_eos", "min_tokens",
                       "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                       at most one of "regex", "json_schema" (object or text), "json_object": true,
                       "ebnf", "choices": [str]; "cache_salt", "timeout" as in the OpenAI API},
   "return_logprob": false, "top_logprobs_num": 0, "prompt_logprobs_from": null, "stream": false}
  -> {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
      "finish_reason", "prompt_logprobs"?, "output_logprobs"? [[logprob, id], ...], "output_top_logprobs"?}}
  A list of prompts answers a list of those (no streaming). stream=true answers Server-Sent
  Events, one `data: {...}` per increment with the *new* text and ids (and meta_info so far;
  "finished": true on the last), then `data: [DONE]`.
  Errors: 400 {"error": {"message", "type", "param", "code"}} (OpenAI's shape, as every route);
  in a stream, a `data: {"error": ...}` event.

POST /tokenize            {"text": str | [str]} -> {"input_ids": [ids] | [[ids], ...]}
                          (as the engine tokenizes a text prompt); or vLLM's forms, {"prompt",
                          "add_special_tokens"?} or {"messages", "add_generation_prompt"?,
                          "continue_final_message"?, "chat_template_kwargs"?, "tools"?} (rendered as
                          the engine renders a chat), with "return_token_strs"? ("model"? in any form)
                          -> {"count", "max_model_len", "tokens", "token_strs"?}
POST /detokenize          {"tokens": [ids], "model"?} -> {"prompt": str}   (special tokens
                          included; an id outside the tokenizer's vocabulary is a 400)
GET  /version             {"version": streamer.__version__}   (no API key needed, as /health)
POST /apply_chat_template {"conversations": [[message, ...], ...]} -> {"texts": [str, ...]}
                          (no generation prompt; an empty conversation renders as "")

These routes live in server/app.py's app and share its guards with the OpenAI routes: the
API key, JSON bodies under the size limit, decoding through protocol.decode_body (400 for
malformed or too deep JSON; token ids are strict ints, so `true` is refused), the request
limits (server/limits.py) before any work, admission (--max-queue counts every prompt of a
batch), and ServerState.start, so that a client that goes away aborts its engine requests,
streaming or not. /tokenize, /detokenize and /apply_chat_template run in a small thread
pool, off the loop.

/generate's pipeline: bytes -> GenerateBody (its sampling_params a NativeSampling) -> the
limits -> generate_requests: SamplingParams (the fields the two share copied by name) and
one GenerateRequest per prompt -> ServerState.start -> one JSON body, or SSE events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from streamer import __version__
from streamer.engine.outputs import merge_outputs
from streamer.errors import RequestError
from streamer.messages import GenerateRequest, GrammarSpec, RequestOutput, SamplingParams
from streamer.server.protocol import ApiError, choice_spec, decode_body, grammar_of, json_schema_spec
from streamer.server.state import Merged, ServerState, failure, until_disconnect
from streamer.server.tokenize_forms import TokenizeBody, vllm_tokenize
from streamer.sse import encode_data

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)


class NativeSampling(msgspec.Struct, kw_only=True):
    """sampling_params: SamplingParams' fields of the same names (copied by name,
    shared_fields), but for stop (a string or a list) and the grammar, which is one of
    regex, json_schema, json_object, ebnf, choices."""

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
    cache_salt: str | None = None
    timeout: float | None = None


class GenerateBody(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    """Token ids, or a list of such lists (msgspec allows one list type per union, so the
    shape is checked in prompts(); the ids themselves are strict ints either way)."""
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    prompt_logprobs_from: int | None = None
    stream: bool = False


class DetokenizeBody(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class ChatTemplateBody(msgspec.Struct):
    conversations: list[list[dict[str, Any]]]


def ok(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def sse(body: Any) -> str:
    return f"data: {encode_data(body)}\n\n"


def shared_fields(src: msgspec.Struct, kind: type[S], **given: Any) -> S:
    """A `kind` with src's value for every field the two share by name, and `given` for the rest."""
    names = {f.name for f in msgspec.structs.fields(kind)} - given.keys()
    return kind(**{f: getattr(src, f) for f in src.__struct_fields__ if f in names}, **given)


def sampling_params(body: GenerateBody) -> SamplingParams:
    """/generate's body -> SamplingParams (the engine validates them: engine/tokenizer.py)."""
    sp = body.sampling_params
    if body.prompt_logprobs_from is not None and body.prompt_logprobs_from < 1:
        raise ApiError(f"prompt_logprobs_from must be >= 1, got {body.prompt_logprobs_from}")
    grammar = grammar_of([
        None if sp.regex is None else GrammarSpec("regex", sp.regex),
        json_schema_spec(sp.json_schema),
        GrammarSpec("json_object") if sp.json_object else None,
        None if sp.ebnf is None else GrammarSpec("ebnf", sp.ebnf),
        choice_spec(sp.choices, "choices", None),
    ], "regex, json_schema, json_object, ebnf, choices")
    return shared_fields(
        sp, SamplingParams, stop=[sp.stop] if isinstance(sp.stop, str) else list(sp.stop or []), grammar=grammar,
        logprobs=body.top_logprobs_num if body.return_logprob else None,
        prompt_logprobs_from=body.prompt_logprobs_from,
    )


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
    if all(isinstance(t, int) for t in ids):
        return [list(ids)], False  # type: ignore[arg-type]
    if all(isinstance(r, list) and r for r in ids):
        return list(ids), True  # type: ignore[arg-type]
    raise RequestError("input_ids must be a list of token ids or a list of non-empty such lists")


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


async def outputs(gen: Merged, buffered: list[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """What ServerState.start returned, as one iterator: the first outputs, then the rest."""
    for item in buffered:
        yield item
    async for item in gen:
        yield item


async def whole(gen: Merged, buffered: list[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """Each engine request's increments merged into one output, in request order."""
    outs: dict[int, RequestOutput] = {}
    try:
        async for i, out in outputs(gen, buffered):
            outs[i] = merge_outputs(outs[i], out) if i in outs else out
    finally:
        await gen.aclose()
    return [outs[i] for i in range(count)]


def engine_request(rid: str, prompt: str | list[int], params: SamplingParams) -> GenerateRequest:
    if isinstance(prompt, str):
        return GenerateRequest(request_id=rid, prompt=prompt, params=params)
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)


def routes() -> list[Route]:
    """The native routes, for server/app.py's app (its ServerState is request.app.state.server)."""
    # tokenizing and templating hold the GIL for most of their time: two threads keep the
    # loop responsive, and more concurrent requests wait their turn rather than share it
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="streamer-native")

    async def off_loop(fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def generate(req: Request) -> Response:
        st: ServerState = req.app.state.server
        body: GenerateBody = decode_body(await req.body(), GenerateBody)
        sp = body.sampling_params
        st.limits.stop(sp.stop, sp.stop_token_ids, "sampling_params.")
        st.limits.choices(sp.choices, "sampling_params.choices")
        try:
            batch, is_batch = prompts(body)
        except RequestError as e:
            raise ApiError(str(e)) from None
        params = st.apply_policy(sampling_params(body), req.scope)
        param = "text" if body.text is not None else "input_ids"
        st.limits.batch(len(batch), param)
        st.limits.prompts(batch, param)
        if body.stream and is_batch:
            raise ApiError("stream needs a single prompt", param="stream")
        reqs = [engine_request(st.engine.new_request_id(), p, params) for p in batch]
        if body.stream:
            return await stream(req, st, reqs[0], body)

        async def run() -> list[RequestOutput]:
            gen, buffered = await st.start(reqs)  # admitted; an engine refusal is a 400 here
            return await whole(gen, buffered, len(reqs))

        outs = await until_disconnect(req, run())  # the client gone: every engine request aborted
        if outs is None:
            return Response(status_code=499)  # nobody reads this
        failed = next((o for o in outs if o.error is not None), None)
        if failed is not None:
            raise failure(failed)
        results = [{"text": o.text, "output_ids": o.token_ids, "meta_info": meta_info(o, body)} for o in outs]
        return ok(results if is_batch else results[0])

    async def stream(req: Request, st: ServerState, r: GenerateRequest, body: GenerateBody) -> Response:
        started = await until_disconnect(req, st.start([r]))  # a refused request must still become a 400
        if started is None:
            return Response(status_code=499)
        gen, buffered = started

        async def events() -> AsyncIterator[str]:
            prompt_logprobs = None
            try:
                async for _, out in outputs(gen, buffered):
                    if out.prompt_logprobs is not None:
                        prompt_logprobs = out.prompt_logprobs
                    if out.error is not None:
                        if out.finish_reason == "timeout":  # what was generated, then why it stopped
                            meta = meta_info(msgspec.structs.replace(out, prompt_logprobs=prompt_logprobs), body)
                            yield sse({"text": out.text, "output_ids": out.token_ids, "meta_info": meta,
                                       "finished": True})
                        yield sse(msgspec.to_builtins(failure(out).body()))
                        break
                    meta = meta_info(msgspec.structs.replace(out, prompt_logprobs=prompt_logprobs), body)
                    yield sse({"text": out.text, "output_ids": out.token_ids, "meta_info": meta,
                               "finished": out.finished})
                    if out.finished:
                        break
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()  # the client went away: the engine aborts the request

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def tokenizer(st: ServerState) -> Any:
        if st.info.hf_tokenizer is None:
            raise ApiError("this model has no tokenizer")
        return st.info.hf_tokenizer

    async def tokenize(req: Request) -> Response:
        st: ServerState = req.app.state.server
        body: TokenizeBody = decode_body(await req.body(), TokenizeBody)
        if sum(x is not None for x in (body.text, body.prompt, body.messages)) != 1:
            raise ApiError("give exactly one of text, prompt (vLLM's form) or messages (vLLM's chat form)")
        st.check_model(body.model)
        if body.text is None:
            return ok(await vllm_tokenize(st, body, tokenizer(st), off_loop))
        vllm_only = [f for f in ("add_special_tokens", "add_generation_prompt", "continue_final_message",
                                 "chat_template_kwargs", "tools") if getattr(body, f) is not None]
        vllm_only += ["return_token_strs"] * body.return_token_strs
        if vllm_only:
            raise ApiError(f"{vllm_only[0]} goes with vLLM's forms (prompt or messages), not with text",
                           param=vllm_only[0])
        texts = [body.text] if isinstance(body.text, str) else body.text
        st.limits.batch(len(texts), "text", "texts")
        st.limits.prompts(texts, "text")
        hf = tokenizer(st)
        ids = await off_loop(lambda: [list(x) for x in hf(texts, add_special_tokens=True)["input_ids"]] if texts else [])
        return ok({"input_ids": ids[0] if isinstance(body.text, str) else ids})

    async def detokenize(req: Request) -> Response:
        st: ServerState = req.app.state.server
        body: DetokenizeBody = decode_body(await req.body(), DetokenizeBody)
        st.check_model(body.model)
        hf = tokenizer(st)
        size = len(hf)  # (the tokenizer's, added tokens included: the model's may pad beyond it)
        bad = next((t for t in body.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary (size {size})", param="tokens")
        text = await off_loop(lambda: hf.decode(body.tokens, skip_special_tokens=False))
        return ok(DetokenizeResponse(text))

    async def version(req: Request) -> Response:
        return ok(VersionResponse(__version__))

    async def apply_chat_template(req: Request) -> Response:
        st: ServerState = req.app.state.server
        body: ChatTemplateBody = decode_body(await req.body(), ChatTemplateBody)
        convs = body.conversations
        st.limits.at_most(len(convs), "max_conversations", "conversations", "conversations")
        chars = sum(st.limits.messages(c, "conversations") for c in convs)
        st.limits.at_most(chars, "max_prompt_chars", "characters of message content", "conversations")
        hf = tokenizer(st)
        try:
            texts = await off_loop(lambda: [hf.apply_chat_template(c, tokenize=False) if c else "" for c in convs])
        except Exception as e:  # noqa: BLE001 - template errors come from the messages
            raise ApiError(f"cannot apply the chat template: {e}", param="conversations") from None
        return ok({"texts": texts})

    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version),
        Route("/apply_chat_template", apply_chat_template, methods=["POST"]),
    ]
