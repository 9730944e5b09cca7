"""/v1/embeddings: one vector per input, as OpenAI's API answers them.

Each input (a string, or token ids; a list of either for several) becomes an engine request
with SamplingParams.embed: its prompt runs as any prompt does (chunked, batched with the
other requests, its prefix cached and shared), and its answer is the final hidden state at
its last token (engine/pooling.py: last-token pooling). Here it is cut to `dimensions`
where asked (Matryoshka embeddings keep their meaning in a prefix), then L2-normalized as
the model's folder says (`normalize` overrides it), and sent as floats or, with
encoding_format "base64", as the base64 of little-endian float32s (what the openai client
asks for by default). A model whose pooling the engine does not compute is refused (400)
with what it lacks.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated

import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from streamer.engine.pooling import unit
from streamer.messages import MAX_CACHE_SALT, GenerateRequest, RequestOutput, SamplingParams
from streamer.server.fields import OTHER_SERVERS_REFUSED, check_refused
from streamer.server.openai_api import json_response, prompts_of, server
from streamer.server.protocol import ApiError, decode_body
from streamer.server.state import Merged, ServerState, failure, until_disconnect

ENCODINGS = ("float", "base64")


class EmbeddingRequest(Struct, kw_only=True):
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    """Accepted without effect (fields.ACCEPTED: an end-user id for OpenAI's abuse monitoring)."""
    normalize: bool | None = None
    """vLLM's extension: L2-normalize (None: as the model's sentence-transformers modules say)."""
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    timeout: Annotated[float, Meta(gt=0.0)] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    """vLLM's extension: embed only the input's last this-many tokens (-1: the context's length)."""


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def gather(gen: Merged, buffered: list[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """Each input's final output, in order; an input the engine refused is the response's error."""
    outs: list[RequestOutput | None] = [None] * count
    try:
        for i, out in buffered:
            outs[i] = out
        async for i, out in gen:
            outs[i] = out
    finally:
        await gen.aclose()
    done = [o for o in outs if o is not None]
    assert len(done) == count
    for out in done:
        if out.error or out.embedding is None:
            raise failure(out)
    return done


def check_pooling(st: ServerState) -> None:
    if st.info.pooling.unsupported is not None:
        raise ApiError(f"{st.info.pooling.unsupported}: this model's embeddings cannot be served", param="model",
                       code="unsupported_model")


async def embed(request: Request, st: ServerState, prompts: list[str | list[int]], prefix: str,
                params: SamplingParams) -> list[RequestOutput] | None:
    """Each prompt's final output (its embedding), in order, as one HTTP request's engine
    requests; None when the client left first."""
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    reqs = [GenerateRequest(request_id=f"{rid}-{i}", prompt=prompt, params=params) if isinstance(prompt, str) else
            GenerateRequest(request_id=f"{rid}-{i}", prompt_token_ids=prompt, params=params)
            for i, prompt in enumerate(prompts)]
    gen, buffered = await st.start(reqs)
    return await until_disconnect(request, gather(gen, buffered, len(reqs)))


def embed_params(st: ServerState, request: Request, cache_salt: str | None, timeout: float | None,
                 truncate: int | None) -> SamplingParams:
    return st.apply_policy(SamplingParams(max_tokens=1, temperature=0, embed=True, cache_salt=cache_salt,
                                          timeout=timeout, truncate_prompt_tokens=truncate), request.scope)


async def embeddings(request: Request) -> Response:
    st = server(request)
    data = await request.body()
    body: EmbeddingRequest = decode_body(data, EmbeddingRequest)
    check_refused(data, OTHER_SERVERS_REFUSED)
    st.check_model(body.model, request.scope)
    check_pooling(st)
    if body.encoding_format not in ENCODINGS:
        raise ApiError(f"encoding_format must be one of {', '.join(ENCODINGS)}, not {body.encoding_format!r}",
                       param="encoding_format")
    try:
        prompts = prompts_of(body.input)
    except ApiError as e:
        raise ApiError(e.message.replace("prompt", "input"), param="input") from None
    st.limits.batch(len(prompts), "input", "inputs")
    st.limits.prompts(prompts, "input")
    params = embed_params(st, request, body.cache_salt, body.timeout, body.truncate_prompt_tokens)
    outs = await embed(request, st, prompts, "embd", params)
    if outs is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    size = len(outs[0].embedding or ())
    if body.dimensions is not None and body.dimensions > size:
        raise ApiError(f"dimensions {body.dimensions} is more than this model's {size}", param="dimensions")
    normalize = st.info.pooling.normalize if body.normalize is None else body.normalize
    vectors = [(o.embedding or [])[: body.dimensions] for o in outs]
    data_out = [Embedding(i, encode(unit(v) if normalize else v, body.encoding_format)) for i, v in enumerate(vectors)]
    tokens = sum(o.prompt_tokens for o in outs)
    return json_response(EmbeddingResponse(data_out, st.answering(request.scope), EmbeddingUsage(tokens, tokens)))
