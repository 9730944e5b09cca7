"""/v1/score and /v1/rerank (also /rerank and /v2/rerank), vLLM's scoring APIs for an embedding
model: a pair's score is the cosine similarity of the two texts' embeddings (embeddings_api.py:
last-token pooling, each text an engine request, a repeated text embedded once).

/v1/score: text_1 and text_2, each a string or a list of strings. One against many scores the
one with each; two lists of the same length score pair by pair. Answer: {"data": [{"index",
"score"}], "usage"}, in text_2's order.

/v1/rerank: a query and its documents; answer: {"results": [{"index", "relevance_score",
"document": {"text"}}], "usage"}, the most relevant first, top_n of them (0 or none: all),
without the documents' text when return_documents is false.

A cross-encoder (a classification head that reads both texts at once) is not among the models
this server runs, so every score is a bi-encoder's.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, TypeVar

import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from streamer.messages import MAX_CACHE_SALT
from streamer.server.embeddings_api import check_pooling, embed, embed_params
from streamer.server.fields import OTHER_SERVERS_REFUSED, check_refused
from streamer.server.openai_api import json_response, server
from streamer.server.protocol import ApiError, decode_body
from streamer.server.state import ServerState


class ScoreRequest(Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    timeout: Annotated[float, Meta(gt=0.0)] | None = None


class RerankRequest(Struct, kw_only=True):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    timeout: Annotated[float, Meta(gt=0.0)] | None = None


Body = TypeVar("Body", ScoreRequest, RerankRequest)


class Usage(Struct):
    prompt_tokens: int
    total_tokens: int


class Score(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[Score]
    usage: Usage
    object: str = "list"


class Document(Struct):
    text: str


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: Document | None = None


class RerankResponse(Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: Usage


def pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The pairs a score request asks for (the module's docstring says which)."""
    one = [text_1] if isinstance(text_1, str) else text_1
    two = [text_2] if isinstance(text_2, str) else text_2
    if not one or not two:
        raise ApiError("text_1 and text_2 must not be empty", param="text_1" if not one else "text_2")
    if len(one) == 1:
        return [(one[0], t) for t in two]
    if len(one) != len(two):
        raise ApiError(f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or as many as text_2",
                       param="text_2")
    return list(zip(one, two, strict=True))


async def similarities(request: Request, st: ServerState, texts: list[tuple[str, str]], prefix: str, what: str,
                       body: ScoreRequest | RerankRequest) -> tuple[list[float], int] | None:
    """Each pair's cosine similarity and the tokens embedded (each distinct text once); None
    when the client left first."""
    check_pooling(st)
    distinct = list(dict.fromkeys(t for pair in texts for t in pair))
    st.limits.batch(len(distinct), what, "texts")
    st.limits.prompts(list(distinct), what)
    params = embed_params(st, request, body.cache_salt, body.timeout, body.truncate_prompt_tokens)
    outs = await embed(request, st, list(distinct), prefix, params)
    if outs is None:
        return None
    vectors = {t: np.asarray(o.embedding, dtype=np.float64) for t, o in zip(distinct, outs, strict=True)}
    units = {t: v / max(float(np.linalg.norm(v)), 1e-12) for t, v in vectors.items()}
    return [float(units[a] @ units[b]) for a, b in texts], sum(o.prompt_tokens for o in outs)


async def read_body(request: Request, kind: type[Body]) -> Body:
    """The request's body, decoded and checked (its refused fields, its model)."""
    data = await request.body()
    body = decode_body(data, kind)
    check_refused(data, OTHER_SERVERS_REFUSED)
    server(request).check_model(body.model, request.scope)
    return body


async def score(request: Request) -> Response:
    st = server(request)
    body = await read_body(request, ScoreRequest)
    asked = pairs(body.text_1, body.text_2)
    got = await similarities(request, st, asked, "score", "text_1 and text_2", body)
    if got is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    scores, tokens = got
    return json_response(ScoreResponse(f"score-{uuid.uuid4().hex[:24]}", int(time.time()), st.answering(request.scope),
                                       [Score(i, s) for i, s in enumerate(scores)], Usage(tokens, tokens)))


async def rerank(request: Request) -> Response:
    st = server(request)
    body = await read_body(request, RerankRequest)
    if not body.documents:
        raise ApiError("documents must not be empty", param="documents")
    got = await similarities(request, st, [(body.query, d) for d in body.documents], "rerank", "documents", body)
    if got is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    scores, tokens = got
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n or None]
    results = [RerankResult(i, scores[i], Document(body.documents[i]) if body.return_documents else None)
               for i in order]
    return json_response(RerankResponse(f"rerank-{uuid.uuid4().hex[:24]}", st.answering(request.scope), results,
                                        Usage(tokens, tokens)))
