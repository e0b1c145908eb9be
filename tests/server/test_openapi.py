"""GET /openapi.json: the spec is generated (jaxserve/server/schemas.py), describes every route
the app serves (the url_map walk: a route added without a schema fails here), agrees with the
hand validator (server/protocol.py) on the bad-input table, answers a wrong method with a 405
and its Allow header, and survives a schemathesis fuzz.

The fuzz runs in process against the Flask app (WSGI) on the tiny random chat model, with a
bounded, derandomized number of examples per operation, on the document the server serves
(`model` is an enum of the served names, so generated requests reach the engine): no response
is a 5xx, every response's status, content type and body are ones the spec declares, and every
operation the server runs answered 200 at least a few times.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import json
import re

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app
from jaxserve.server.openapi import openapi_document, served_document
from test_server import CASES, C, H, MODEL
from jaxserve.testing.tiny_chat import tiny_chat_model

MAX_MODEL_LEN = 64  # short generations: the fuzz spends its time on requests, not decoding
MAX_NUM_SEQS = 4
FUZZ_EXAMPLES = 25  # per operation
# No 5xx; status, content type and body as declared; a schema-invalid body gets a 4xx. Not
# positive_data_acceptance: a schema-valid body may still be a 400 (SEMANTIC_ONLY below, and
# e.g. a random string that is no grammar).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]

# Bad inputs the schema cannot express: they depend on the served model (its vocabulary and
# context), on two fields together, or on the body's bytes before it is JSON. The validator
# alone refuses these; each is still a 4xx (tests/server/test_server.py::test_validation).
SEMANTIC_ONLY = {
    "bad-json": "not JSON at all",
    "token-id-over-vocab": "the vocabulary size", "prompt-too-long": "the context length",
    "prompt-plus-max-tokens": "the context length",
    "temperature-nan": "NaN/Infinity are not JSON",
    "temperature-inf": "NaN/Infinity are not JSON",
    "n-over-limit": "the server's max_n", "stream-options-without-stream": "two fields",
    "min-tokens-over-max": "two fields", "top-logprobs-without-logprobs": "two fields",
    "body-too-large": "the server's body limit",
}
GOOD = [("/v1/completions", C()), ("/v1/completions", C(prompt=[1, 2, 3], n=2, logprobs=3,
                                                          stop=["x", "yz"], seed=7)),
        ("/v1/completions", C(prompt=[[1, 2], [3]], stream=True,
                              stream_options={"include_usage": True})),
        ("/v1/chat/completions", H()),
        ("/v1/chat/completions", H(logprobs=True, top_logprobs=2, temperature=0,
                                   max_completion_tokens=3, extra_field="ignored")),
        ("/v1/chat/completions", H(messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}]))]
LABELS = {f"{m} {p}" for m, p in [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/embeddings"), ("GET", "/v1/models"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
    ("GET", "/v1/engine/state"), ("POST", "/start_profile"), ("POST", "/stop_profile"),
    ("GET", "/health"), ("GET", "/metrics"), ("GET", "/openapi.json")]}
# Off on the fuzzed server: no --enable-lora, no --profile-dir, no tokenizer info, no stored
# responses.
OFF_HERE = {"POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "POST /start_profile",
            "POST /stop_profile", "GET /tokenizer_info", "GET /v1/responses/{response_id}"}
ROUTE_SCHEMA = {"/v1/completions": "CompletionRequest",
                "/v1/chat/completions": "ChatCompletionRequest",
                "/v1/responses": "ResponsesRequest",
                "/v1/embeddings": "EmbeddingRequest"}
GOOD += [("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4}),
         ("/v1/responses", {"model": MODEL, "instructions": "Be brief.", "store": False,
                            "input": [{"role": "user", "content": [
                                {"type": "input_text", "text": "hi"}]},
                                {"type": "function_call", "call_id": "c", "name": "f",
                                 "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c",
                                 "output": "ok"}],
                            "tools": [{"type": "function", "name": "f"}],
                            "text": {"format": {"type": "json_object"}},
                            "truncation": "disabled", "metadata": {"k": "v"}}),
         ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
         ("/v1/embeddings", {"model": MODEL, "input": [[1, 2], [3]],
                             "encoding_format": "base64", "dimensions": 64, "user": "u",
                             "normalize": False})]


def request_validator(path: str) -> jsonschema.Draft202012Validator:
    doc = served_document(openapi_document(), [MODEL])
    root = {**doc, "$ref": f"#/components/schemas/{ROUTE_SCHEMA[path]}"}
    return jsonschema.Draft202012Validator(root)


def test_document_is_generated_and_valid_openapi():
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    assert {"minLength": 1, "type": "string"} in prompt["anyOf"]  # from the pydantic type
    assert schemas["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]["maximum"] == 20
    for path in ROUTE_SCHEMA:
        assert {"400", "503"} <= set(doc["paths"][path]["post"]["responses"])
    from schemathesis.openapi import from_dict
    labels = {result.ok().label for result in from_dict(doc).get_all_operations()}
    assert labels == LABELS  # schemathesis reads every operation
    unload = doc["paths"]["/v1/unload_lora_adapter"]["post"]["responses"]
    assert {"200", "400", "401", "404", "409"} <= set(unload)
    assert set(unload["200"]["content"]) == {"text/plain"}  # vLLM's one-line answer
    card = schemas["ModelCard"]["properties"]
    assert {"parent", "root"} <= set(card)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_schema_agrees_with_validator_on_bad_inputs(case):
    label, path, body, status, *_ = case
    assert 400 <= status < 500
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            assert label in SEMANTIC_ONLY
            return
    errors = list(request_validator(path).iter_errors(body))
    if label in SEMANTIC_ONLY:
        assert not errors, f"{label}: the schema now rejects it; drop it from SEMANTIC_ONLY"
    else:
        assert errors, f"{label}: the validator refuses it ({status}) but the schema allows it"


@pytest.mark.parametrize("path,body", GOOD)
def test_schema_accepts_good_bodies(path, body):
    assert not list(request_validator(path).iter_errors(body))


# ---- the schemathesis fuzz ------------------------------------------------------------------

@pytest.fixture(scope="module")
def app():
    model = tiny_chat_model(seed=0)
    kv = 2 * MAX_NUM_SEQS * MAX_MODEL_LEN * model.config.kv_bytes_per_token(4)
    engine = LLMEngine(EngineConfig(model=model.source, warmup=True, max_num_seqs=MAX_NUM_SEQS,
                                    max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                                    block_size=MAX_MODEL_LEN, kv_cache_memory=kv,
                                    enable_embeddings=True), model=model)
    loop = EngineLoop(engine).start()
    yield create_app(loop, ServerConfig(served_model_name=MODEL, max_body_bytes=1 << 16))
    loop.stop()


def default_float_environment() -> None:
    """Clears flush-to-zero / denormals-are-zero in this thread: XLA's CPU runtime sets them
    while it computes (warm-up ran here), and hypothesis refuses to generate floats without
    subnormals. glibc's fesetenv(FE_DFL_ENV), FE_DFL_ENV being (fenv_t *) -1."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    assert libm.fesetenv(ctypes.c_void_p(-1)) == 0


def test_openapi_fuzz(app):
    default_float_environment()
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    # The LoRA routes answer 400 here (no --enable-lora), the profiling ones 404 (no
    # --profile-dir); the others reach the engine or the tokenizer. Schemathesis leaves out
    # the document's own path.
    assert {op.label for op in operations} == LABELS - {"GET /openapi.json"}
    statuses = {op.label: collections.Counter() for op in operations}
    for operation in operations:
        fuzz_operation(operation, statuses[operation.label])
    print({label: dict(c) for label, c in statuses.items()})
    # Every operation the server runs here was reached, not only refused (say with a 404
    # for a model name the document did not give).
    for label, counts in statuses.items():
        wanted = 0 if label in OFF_HERE else min(3, sum(counts.values()))  # GETs run once
        assert counts[200] >= wanted, (label, counts)
    total = sum(statuses.values(), collections.Counter())
    assert total[400] >= 10, total  # and the validator refused some schema-valid bodies


def fuzz_operation(operation, statuses: collections.Counter) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        statuses[case.call_and_validate(checks=CHECKS).status_code] += 1

    run()


# ---- every route is documented; a wrong method is a 405 that says which are right -----------

# Routes the document leaves out on purpose, with the reason.
UNDOCUMENTED = {"/": "the web page itself (HTML, not an API)",
                "/ui/<path:name>": "the web page's static files (JS, CSS)"}
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def openapi_path(rule: str) -> str:
    """werkzeug's /a/<conv:name> as OpenAPI's /a/{name}."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def test_document_describes_every_route(app):
    """A route added without a schema fails here (so does a documented path nobody serves)."""
    paths = openapi_document()["paths"]
    served = {}
    for rule in app.url_map.iter_rules():
        if rule.rule in UNDOCUMENTED:
            continue
        methods = {m.lower() for m in rule.methods - {"HEAD", "OPTIONS"}}
        served.setdefault(openapi_path(rule.rule), set()).update(methods)
    undocumented = {p: sorted(m - set(paths.get(p, {}))) for p, m in served.items()
                    if not m <= set(paths.get(p, {}))}
    assert not undocumented, f"routes missing from /openapi.json: {undocumented}"
    assert set(paths) == set(served), f"documented but not served: {set(paths) - set(served)}"
    for path, ops in paths.items():
        assert set(ops) == served[path], path


def test_wrong_method_is_405_with_allow_header(app):
    """RFC 9110: a 405 lists the methods the resource supports (schemathesis' ST204)."""
    client = app.test_client()
    for path, ops in openapi_document()["paths"].items():
        declared = {m.upper() for m in ops}
        for method in sorted(set(METHODS) - declared):
            r = client.open(path, method=method)
            assert r.status_code == 405, (method, path, r.status_code)
            assert r.get_json()["error"]["code"] == "method_not_allowed"
            allow = {m.strip() for m in r.headers.get("Allow", "").split(",") if m.strip()}
            assert allow - {"HEAD", "OPTIONS"} == declared, (method, path, allow)
