"""GET /openapi.json: an OpenAPI 3.1 document assembled from the pydantic models in schemas.py.

Only the paths and their responses are written here; every body schema is generated
(`models_json_schema`, refs pointing into components/schemas). Each operation declares the
error responses the handlers can give (the OpenAI error body), so a fuzzer can check that every
response the server sends is one the spec allows.
"""

from __future__ import annotations

from flask import Flask, jsonify
from pydantic.json_schema import models_json_schema

from jaxserve.server import schemas

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {
    "400": "invalid request: the error names the offending param",
    "401": "missing or wrong API key (when the server has one)",
    "404": "unknown model (or LoRA adapter), or a feature the server was started without",
    "405": "wrong method (the Allow header lists the right ones)",
    "409": "conflict: the LoRA adapter is in use, or a capture is (not) running",
    "413": "body larger than the server's limit",
    "500": "internal error (a bug; the body says nothing more)",
    "503": "queue full, shutting down or engine down; retry later",
}
# Every route with a body can be refused for its size or shape; every route can fail.
BODY_ERRORS = ("400", "401", "405", "413", "500")


def _ref(model) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(*codes: str) -> dict:
    body = {"application/json": {"schema": _ref(schemas.ErrorResponse)}}
    return {c: {"description": ERROR_STATUSES[c], "content": body} for c in sorted(set(codes))}


def _json(schema: dict, description: str = "ok") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str) -> dict:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


def _operation(method: str, summary: str, ok: dict, errors: tuple[str, ...],
               request: dict | None = None, body_required: bool = True) -> dict:
    op = {"summary": summary, "operationId": summary.replace(" ", "_"),
          "responses": {"200": ok, **_errors(*errors)}}
    if request is not None:
        op["requestBody"] = {"required": body_required,
                             "content": {"application/json": {"schema": request}}}
    return {method: op}


def _generation(summary: str, request, response) -> dict:
    ok = {"description": "the completion (JSON), or with stream: true server-sent events "
                         "ending in data: [DONE]",
          "content": {"application/json": {"schema": _ref(response)},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return _operation("post", summary, ok, BODY_ERRORS + ("404", "503"), _ref(request))


def _post(summary: str, request, response, *errors: str) -> dict:
    return {"post": {
        "summary": summary, "operationId": summary.replace(" ", "_"),
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "ok", "content": {
            "application/json": {"schema": _ref(response)}}}, **_errors(*errors)}}}


def _lora_admin(summary: str, request, *errors: str) -> dict:
    return _operation("post", summary, _text("done: a one-line text, as vLLM answers"),
                      BODY_ERRORS + errors, _ref(request))


def _get(summary: str, response, *errors: str) -> dict:
    return _operation("get", summary, _json(_ref(response)), errors)


def _paths() -> dict:
    s = schemas
    tokenize_request = {"anyOf": [_ref(s.TokenizeCompletionRequest), _ref(s.TokenizeChatRequest)]}
    return {
        "/v1/completions": _generation("create completion", s.CompletionRequest,
                                       s.CompletionResponse),
        "/v1/chat/completions": _generation("create chat completion", s.ChatCompletionRequest,
                                            s.ChatCompletionResponse),
        "/v1/responses": _generation("create response", s.ResponsesRequest,
                                     s.ResponsesResponse),
        "/v1/responses/{response_id}": _stored_response(),
        "/v1/embeddings": _post("create embeddings", s.EmbeddingRequest, s.EmbeddingResponse,
                                "400", "401", "404", "405", "413", "500", "503"),
        "/v1/models": _get("list models", s.ModelList, "401", "500"),
        # 400 also when the server was started without --enable-lora.
        "/v1/load_lora_adapter": _lora_admin("load lora adapter", s.LoadLoRAAdapterRequest),
        "/v1/unload_lora_adapter": _lora_admin("unload lora adapter",
                                               s.UnloadLoRAAdapterRequest, "404", "409"),
        "/tokenize": _operation("post", "tokenize", _json(_ref(s.TokenizeResponse)),
                                BODY_ERRORS + ("404",), tokenize_request),
        "/detokenize": _operation("post", "detokenize", _json(_ref(s.DetokenizeResponse)),
                                  BODY_ERRORS + ("404",), _ref(s.DetokenizeRequest)),
        # 404 unless the server was started with --enable-tokenizer-info-endpoint.
        "/tokenizer_info": _get("tokenizer info", s.TokenizerInfo, "400", "401", "404", "500"),
        "/v1/engine/state": _get("engine state", s.EngineState, "401", "500", "503"),
        # 404 unless the server was started with --profile-dir.
        "/start_profile": _operation("post", "start profile", _json(_ref(s.ProfileStarted)),
                                     BODY_ERRORS + ("404", "409"),
                                     _ref(s.StartProfileRequest), body_required=False),
        "/stop_profile": _operation("post", "stop profile", _json(_ref(s.ProfileStopped)),
                                    ("401", "404", "405", "409", "500")),
        "/health": _get("health", s.Health, "500", "503"),
        "/metrics": _operation("get", "metrics",
                               _text("Prometheus text exposition (vllm:* and jaxserve "
                                     "families)"), ("401", "500")),
        "/openapi.json": _operation("get", "openapi", _json({"type": "object"},
                                                            "this document"), ("401", "500")),
    }


def _stored_response() -> dict:
    op = _get("get response", schemas.ResponsesResponse, "401", "404", "500")
    op["get"]["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]
    op["get"]["description"] = ("a response kept with store: true (404 when it was not, was "
                                "dropped, or the server keeps none)")
    return op


def openapi_document(title: str = "jaxserve", version: str = "0.1.0") -> dict:
    """The document, with `model` any string; the served one names the models
    (`served_document`)."""
    _, defs = models_json_schema([(m, "validation") for m in schemas.SCHEMAS],
                                 ref_template=REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible completions, chat completions and "
                                "responses, embeddings, and "
                                "vLLM's tokenizer, LoRA and profiling routes. Bodies are "
                                "checked by the server beyond these schemas (prompt length, "
                                "token ids, cross-field rules); those are 400s."},
        "paths": _paths(),
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def served_document(document: dict, model_names: list[str]) -> dict:
    """`document` with `model` restricted to the names served now (adapters come and go), so
    a client or a fuzzer reading it names a model that exists."""
    components = document["components"]
    name = dict(components["schemas"]["ModelName"], enum=list(model_names),
                examples=list(model_names[:1]))
    return {**document, "components": {**components, "schemas": {
        **components["schemas"], "ModelName": name}}}


def register_openapi_routes(app: Flask, state) -> None:
    document = openapi_document()  # built once: only the served names change while serving

    @app.get("/openapi.json")
    def openapi_json():
        return jsonify(served_document(document, state.models.names()))
