"""GET /openapi.json: the spec is generated (jaxserve/server/schemas.py), agrees with the hand
validator (server/protocol.py) on the bad-input table, and survives a schemathesis fuzz.

The fuzz runs in process against the Flask app (WSGI) on the tiny random chat model, with a
bounded, derandomized number of examples per operation: no response is a 5xx, and every
response's status, content type and body are ones the spec declares.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import json

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
from jaxserve.server.openapi import openapi_document
from test_server import CASES, C, H, MODEL
from jaxserve.testing.tiny_chat import tiny_chat_model

MAX_MODEL_LEN = 64  # short generations: the fuzz spends its time on requests, not decoding
MAX_NUM_SEQS = 4
FUZZ_EXAMPLES = 25  # per operation (7 operations)
# No 5xx; status, content type and body as declared; a schema-invalid body gets a 4xx. Not
# positive_data_acceptance: a schema-valid body may still be a 400 (SEMANTIC_ONLY below, and
# e.g. a random string that is no grammar).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]

# Bad inputs the schema cannot express: they depend on the served model (its vocabulary and
# context), on two fields together, or on the body's bytes before it is JSON. The validator
# alone refuses these; each is still a 4xx (tests/server/test_server.py::test_validation).
SEMANTIC_ONLY = {
    "bad-json": "not JSON at all", "unknown-model": "the served model's name",
    "token-id-over-vocab": "the vocabulary size", "prompt-too-long": "the context length",
    "prompt-plus-max-tokens": "the context length",
    "temperature-nan": "NaN/Infinity are not JSON",
    "temperature-inf": "NaN/Infinity are not JSON",
    "n-over-limit": "the server's max_n", "stream-options-without-stream": "two fields",
    "min-tokens-over-max": "two fields", "top-logprobs-without-logprobs": "two fields",
    "echo-with-logprobs": "two fields", "tool-without-name": "tool schemas are free-form",
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
            {"type": "text", "text": "hi"}]}])),
        ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
        ("/v1/embeddings", {"model": MODEL, "input": [[1, 2], [3]], "encoding_format": "base64",
                            "dimensions": 64, "user": "u", "normalize": False})]
ROUTE_SCHEMA = {"/v1/completions": "CompletionRequest",
                "/v1/chat/completions": "ChatCompletionRequest",
                "/v1/embeddings": "EmbeddingRequest"}


def request_validator(path: str) -> jsonschema.Draft202012Validator:
    doc = openapi_document()
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
    assert len(list(from_dict(doc).get_all_operations())) == 7  # schemathesis accepts it
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
    assert len(operations) == 7  # the LoRA routes answer 400 here: no --enable-lora
    statuses = collections.Counter()
    for operation in operations:
        fuzz_operation(operation, statuses)
    # The fuzz reached both generation and refusal (not only 404s for a wrong model name).
    assert statuses[200] >= 10 and statuses[400] >= 10, statuses


def fuzz_operation(operation, statuses: collections.Counter) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # mostly reach the validator, not the unknown-model 404
        statuses[case.call_and_validate(checks=CHECKS).status_code] += 1

    run()
