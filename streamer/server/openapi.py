"""GET /openapi.json: OpenAPI 3.1, from the JSON schemas of the routes' Structs.

The fuzzing tests (tests/reliability/test_fuzz.py) read it: every POST route here has its
request body as a $ref to a component schema.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamer.server.anthropic_api import CountTokensRequest, MessagesRequest
from streamer.server.api_error import ErrorResponse
from streamer.server.embeddings_api import EmbeddingRequest, EmbeddingResponse
from streamer.server.lora_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from streamer.server.native_api import DetokenizeBody, DetokenizeResponse, TokenizeBody, VersionResponse
from streamer.server.protocol import ChatCompletionRequest, CompletionRequest
from streamer.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    ResponseObject,
)
from streamer.server.responses_api import ResponsesRequest
from streamer.server.score_api import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse


def openapi_document(version: str) -> dict[str, Any]:
    kinds = [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse,
             ModelList, ModelCard, ErrorResponse, TokenizeBody, DetokenizeBody, DetokenizeResponse, VersionResponse,
             ResponsesRequest, ResponseObject, EmbeddingRequest, EmbeddingResponse, MessagesRequest, CountTokensRequest,
             ScoreRequest, ScoreResponse, RerankRequest, RerankResponse, LoadLoraAdapterRequest,
             UnloadLoraAdapterRequest]
    (req_c, req_ch, res_c, res_ch, models, card, err, tok, detok, detok_res, ver, req_r, res_r, req_e, res_e, req_m,
     req_ct, req_s, res_s, req_rr, res_rr, req_load, req_unload), comps = \
        msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")

    def error(status: int, why: str) -> dict:
        return {str(status): {"description": why, "content": {"application/json": {"schema": err}}}}

    errors = {**error(400, "invalid request"), **error(401, "missing or wrong API key"),
              **error(404, "the model does not exist (code model_not_found)"),
              **error(503, "queue full, shutting down, or the engine down or not responding"),
              **error(504, "the request's deadline passed (timeout, --request-timeout)")}

    def post(req: dict, res: dict, summary: str, stream: bool = True) -> dict:
        content: dict[str, Any] = {"application/json": {"schema": res}}
        if stream:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        ok = {"description": "a response, or an SSE stream of chunks when stream is true" if stream else "ok",
              "content": content}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": req}}}, "responses": {"200": ok, **errors}}}

    def get(summary: str, schema: dict | None = None, media: str = "application/json", **more: Any) -> dict:
        content = {media: {"schema": schema or {"type": "string" if media != "application/json" else "object"}}}
        return {"get": {"summary": summary, "responses": {"200": {"description": "ok", "content": content}},
                        **more}}

    model_param = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    resp_param = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "streamer", "version": version},
        "paths": {
            "/v1/completions": post(req_c, res_c, "Text completion"),
            "/v1/chat/completions": post(req_ch, res_ch, "Chat completion"),
            "/v1/responses": post(req_r, res_r, "A response (OpenAI's Responses API)"),
            "/v1/responses/{response_id}": {
                **get("A stored response (404, code response_not_found, when none)", res_r, parameters=resp_param),
                "delete": {"summary": "Forget a stored response", "parameters": resp_param,
                           "responses": {"200": {"description": "deleted"}, **errors}}},
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "Cancel a background response (400 for one that did not run in the background)",
                "parameters": resp_param, "responses": {"200": {"description": "the response"}, **errors}}},
            "/v1/responses/{response_id}/input_items": get(
                "The items a stored response ran with, instructions apart (order, limit, after)", parameters=resp_param),
            "/v1/embeddings": post(req_e, res_e, "Embeddings (last-token pooling)", stream=False),
            "/v1/score": post(req_s, res_s, "Cosine similarity of text pairs' embeddings (vLLM's)", stream=False),
            "/v1/rerank": post(req_rr, res_rr, "Documents ordered by their embeddings' cosine similarity to the query "
                               "(vLLM's; also /rerank and /v2/rerank)", stream=False),
            "/v1/load_lora_adapter": post(req_load, {"type": "string"}, "Load a LoRA adapter folder under a name "
                                          "(vLLM's; needs --allow-runtime-lora-updating)", stream=False),
            "/v1/unload_lora_adapter": post(req_unload, {"type": "string"}, "Unload a LoRA adapter (vLLM's; 404 for "
                                            "a name none has)", stream=False),
            "/v1/messages": post(req_m, {"type": "object"}, "Anthropic's Messages API (errors in Anthropic's shape)"),
            "/v1/messages/count_tokens": post(req_ct, {"type": "object"}, "The prompt's tokens, as the engine runs it",
                                              stream=False),
            "/v1/models": get("Served models", models),
            "/v1/models/{model}": get("One served model (404, code model_not_found, for any other)", card,
                                      parameters=model_param),
            "/tokenize": post(tok, {"type": "object"}, "Text -> token ids, as the engine tokenizes a prompt (also "
                              "vLLM's prompt and messages forms: count, max_model_len, tokens)", stream=False),
            "/invocations": post({"oneOf": [req_ch, req_c, req_e]}, {"type": "object"},
                                 "vLLM's (SageMaker's): a chat completion, completion or embeddings body, by its "
                                 "messages, prompt or input"),
            "/detokenize": post(detok, detok_res, "Token ids -> text (400 for an id outside the vocabulary)",
                                stream=False),
            "/version": get("The server's version", ver),
            "/health": get("200 while the engine serves; 503 when it is down or stalled (no heartbeat)"),
            "/ping": get("/health, as SageMaker asks for it (GET or POST)"),
            "/metrics": get("Prometheus metrics", media="text/plain"),
        },
        "components": {"schemas": comps},
    }
