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
    "404": "unknown model (or LoRA adapter)",
    "405": "wrong method",
    "409": "the LoRA adapter is in use by unfinished requests (nothing changed)",
    "413": "body larger than the server's limit",
    "500": "internal error (a bug; the body says nothing more)",
    "503": "queue full, shutting down or engine down; retry later",
}


def _ref(model) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(*codes: str) -> dict:
    body = {"application/json": {"schema": _ref(schemas.ErrorResponse)}}
    return {c: {"description": ERROR_STATUSES[c], "content": body} for c in codes}


def _generation(summary: str, request, response) -> dict:
    ok = {"description": "the completion (JSON), or with stream: true server-sent events "
                         "ending in data: [DONE]",
          "content": {"application/json": {"schema": _ref(response)},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {"post": {
        "summary": summary, "operationId": summary.replace(" ", "_"),
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": ok, **_errors("400", "401", "404", "405", "413", "500", "503")}}}


def _post(summary: str, request, response, *errors: str) -> dict:
    return {"post": {
        "summary": summary, "operationId": summary.replace(" ", "_"),
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "ok", "content": {
            "application/json": {"schema": _ref(response)}}}, **_errors(*errors)}}}


def _lora_admin(summary: str, request, *errors: str) -> dict:
    ok = {"description": "done: a one-line text, as vLLM answers",
          "content": {"text/plain": {"schema": {"type": "string"}}}}
    return {"post": {
        "summary": summary, "operationId": summary.replace(" ", "_"),
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": ok, **_errors(*errors)}}}


def _get(summary: str, response, *errors: str) -> dict:
    return {"get": {"summary": summary, "operationId": summary.replace(" ", "_"),
                    "responses": {"200": {"description": "ok", "content": {
                        "application/json": {"schema": _ref(response)}}},
                        **_errors(*errors)}}}


def openapi_document(title: str = "jaxserve", version: str = "0.1.0") -> dict:
    _, defs = models_json_schema([(m, "validation") for m in schemas.SCHEMAS],
                                 ref_template=REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible completions, chat completions and "
                                "embeddings. Bodies "
                                "are checked by the server beyond these schemas (prompt "
                                "length, token ids, cross-field rules); those are 400s."},
        "paths": {
            "/v1/completions": _generation("create completion", schemas.CompletionRequest,
                                           schemas.CompletionResponse),
            "/v1/chat/completions": _generation("create chat completion",
                                                schemas.ChatCompletionRequest,
                                                schemas.ChatCompletionResponse),
            "/v1/embeddings": _post("create embeddings", schemas.EmbeddingRequest,
                                    schemas.EmbeddingResponse, "400", "401", "404", "405",
                                    "413", "500", "503"),
            "/v1/models": _get("list models", schemas.ModelList, "401", "500"),
            # 400 also when the server was started without --enable-lora.
            "/v1/load_lora_adapter": _lora_admin("load lora adapter",
                                                 schemas.LoadLoRAAdapterRequest,
                                                 "400", "401", "405", "413", "500"),
            "/v1/unload_lora_adapter": _lora_admin("unload lora adapter",
                                                   schemas.UnloadLoRAAdapterRequest,
                                                   "400", "401", "404", "405", "409", "413",
                                                   "500"),
            "/health": _get("health", schemas.Health, "500", "503"),
        },
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def register_openapi_routes(app: Flask, state) -> None:
    document = openapi_document()  # built once: the schemas do not change while serving

    @app.get("/openapi.json")
    def openapi_json():
        return jsonify(document)
