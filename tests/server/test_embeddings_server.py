"""POST /v1/embeddings over real HTTP with the official `openai` client, against HF
transformers' hidden states on the same weights (tests/embedding_reference.py: the tiny chat
model's shapes and tokenizer, its weights made and saved by transformers).

The engine pools the last token (the default) and runs in the server's engine loop; a mixed
test checks that embedding rows and a chat completion's decodes share steps. The engine has
the shapes of tests/engine/test_embeddings_hf.py, so its programs come from the persistent
compilation cache when that file ran first.
"""

import base64
import concurrent.futures as cf
import json

import jsonschema
import numpy as np
import openai
import pytest
import requests

from embedding_reference import (ID_PROMPTS, LONG, MAX_MODEL_LEN, TEXTS, embedding_reference,
                                 hf_embedding, load_tiny_chat, text_ids)
from http_server import serving
from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from jaxserve.server.openapi import openapi_document
from jaxserve.testing.tiny_models import TINY_CHAT
from test_server import wait_idle

pytestmark = pytest.mark.hf_ref

MODEL = "tiny-chat"
ATOL = 1e-5  # unit-norm embeddings, float32 vs float32 (see tests/engine/test_embeddings_hf.py)
RAW_ATOL = 2e-4
MAX_NUM_SEQS = 4
MAX_WAITING = 12  # the server's bound on queued requests: also its bound on inputs per request
EMB = "/v1/embeddings"


@pytest.fixture(scope="module")
def engine():
    kv = 20 * 16 * TINY_CHAT.kv_bytes_per_token(4)
    return LLMEngine(EngineConfig(
        model="tiny-chat-hf", dtype="float32", enable_embeddings=True, max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=16, block_size=16, max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=kv, structured_outputs=False, warmup=True), model=load_tiny_chat())


@pytest.fixture(scope="module")
def plans(engine):
    """Every plan the engine launches (the runner's launch wrapped before the loop starts)."""
    log, launch = [], engine.runner.launch

    def recorded(plan):
        log.append(plan)
        return launch(plan)
    engine.runner.launch = recorded
    return log


@pytest.fixture(scope="module")
def loop(engine, plans):
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def server(loop):
    with serving(loop, ServerConfig(served_model_name=MODEL,
                                    max_waiting_requests=MAX_WAITING)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def post(server, body):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + EMB, data=data, timeout=120)


def want(ids, normalize=True):
    return hf_embedding(embedding_reference().of(ids), "last", normalize)


def test_client_strings_match_hf(client):
    # The client asks for base64 unless told otherwise and decodes it to floats.
    out = client.embeddings.create(model=MODEL, input=TEXTS)
    assert out.object == "list" and out.model == MODEL
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    for d, ids in zip(out.data, text_ids()):
        assert d.object == "embedding" and len(d.embedding) == TINY_CHAT.hidden_size
        np.testing.assert_allclose(d.embedding, want(ids), atol=ATOL, rtol=0)
    tokens = sum(len(ids) for ids in text_ids())
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    one = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float",
                                   user="someone", dimensions=TINY_CHAT.hidden_size)
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(text_ids()[1])
    np.testing.assert_allclose(one.data[0].embedding, want(text_ids()[1]), atol=ATOL, rtol=0)


def test_client_token_ids_match_hf(client):
    # LONG is chunked (16-token steps); the last prompt is exactly max_model_len tokens.
    prompts = [ID_PROMPTS[0], LONG, ID_PROMPTS[-1]]
    assert len(ID_PROMPTS[-1]) == MAX_MODEL_LEN
    out = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    for d, ids in zip(out.data, prompts):
        np.testing.assert_allclose(d.embedding, want(ids), atol=ATOL, rtol=0)
    single = client.embeddings.create(model=MODEL, input=ID_PROMPTS[1])
    np.testing.assert_allclose(single.data[0].embedding, want(ID_PROMPTS[1]), atol=ATOL, rtol=0)


def test_raw_base64_and_unnormalised(server):
    r = post(server, {"model": MODEL, "input": [ID_PROMPTS[0]], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    body = r.json()
    jsonschema.validate(body, schema("EmbeddingResponse"))
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, want(ID_PROMPTS[0]), atol=ATOL, rtol=0)
    assert body["id"].startswith("embd-") and isinstance(body["created"], int)
    r = post(server, {"model": MODEL, "input": ID_PROMPTS[0], "normalize": False})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                               want(ID_PROMPTS[0], normalize=False), atol=RAW_ATOL, rtol=0)


def test_embeddings_and_generation_share_steps(client, engine, plans):
    """A chat completion decodes while embedding requests arrive: their rows run in the same
    steps as its decodes, and neither changes the other's result."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**chat).choices[0].message.content
    start = len(plans)
    with cf.ThreadPoolExecutor(2) as pool:
        stream = client.chat.completions.create(stream=True, **chat)
        chunks = iter(stream)
        text = next(chunks).choices[0].delta.content or ""  # decoding has started
        embedded = pool.submit(client.embeddings.create, model=MODEL,
                               input=[LONG, ID_PROMPTS[3]], encoding_format="float")
        text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        out = embedded.result()
    assert text == alone
    for d, ids in zip(out.data, [LONG, ID_PROMPTS[3]]):
        np.testing.assert_allclose(d.embedding, want(ids), atol=ATOL, rtol=0)
    mixed = [p for p in plans[start:] if p.pooled and any(
        item.request_id not in p.pooled for item in p.schedule.decodes)]
    assert mixed, "no step ran the chat's decodes and embedding rows together"


# Bad bodies: (label, body, param, code); each is a 400 naming `param`.
TOO_LONG = [1] * (MAX_MODEL_LEN + 1)
BAD = [
    ("missing-input", {}, "input", "missing_field"),
    ("empty-string", {"input": ""}, "input", None),
    ("empty-list", {"input": []}, "input", None),
    ("empty-string-in-list", {"input": ["a", ""]}, "input", None),
    ("empty-ids-in-list", {"input": [[1], []]}, "input", None),
    ("mixed-list", {"input": ["a", 1]}, "input", None),
    ("number", {"input": 5}, "input", None),
    ("object", {"input": {"text": "a"}}, "input", None),
    ("bool-ids", {"input": [True, 1]}, "input", None),
    ("float-ids", {"input": [1.5, 2]}, "input", None),
    ("id-over-vocab", {"input": [1, TINY_CHAT.vocab_size]}, "input", "invalid_token_id"),
    ("negative-id", {"input": [[1, -1]]}, "input", "invalid_token_id"),
    ("too-long", {"input": TOO_LONG}, "input", "context_length_exceeded"),
    ("one-too-long", {"input": [[1, 2], TOO_LONG]}, "input", "context_length_exceeded"),
    ("too-many", {"input": [[1]] * (MAX_NUM_SEQS + MAX_WAITING + 1)}, "input", None),
    ("encoding-format", {"input": "a", "encoding_format": "hex"}, "encoding_format", None),
    ("dimensions-shorter", {"input": "a", "dimensions": 32}, "dimensions", None),
    ("dimensions-zero", {"input": "a", "dimensions": 0}, "dimensions", None),
    ("dimensions-string", {"input": "a", "dimensions": "64"}, "dimensions", None),
    ("user-number", {"input": "a", "user": 5}, "user", None),
    ("normalize-string", {"input": "a", "normalize": "yes"}, "normalize", None),
    ("truncate", {"input": "a", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens",
     "unsupported"),
    ("missing-model", {"input": "a", "model": None}, "model", "missing_field"),
]
# Refused by the validator only: the limit depends on the model or the server.
SEMANTIC_ONLY = {"id-over-vocab", "too-long", "one-too-long", "too-many",
                 "dimensions-shorter"}


@pytest.mark.parametrize("label,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_400s(server, label, body, param, code):
    r = post(server, {"model": MODEL, **body})
    assert r.status_code == 400, (label, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if label == "too-long":
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        assert f"has {MAX_MODEL_LEN + 1} tokens" in error["message"]


@pytest.mark.parametrize("label,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_schema_agrees_with_validator(label, body, param, code):
    errors = list(validator("EmbeddingRequest").iter_errors({"model": MODEL, **body}))
    if label in SEMANTIC_ONLY:
        assert not errors, f"{label}: the schema now rejects it; drop it from SEMANTIC_ONLY"
    else:
        assert errors, f"{label}: the validator refuses it but the schema allows it"


def test_unknown_model_and_bad_json(server):
    r = post(server, {"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(server, b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_nothing_left_behind(server, loop):
    stats = wait_idle(loop, loop.stats()["kv_blocks_total"])
    assert stats["num_compiles_after_warmup"] == 0


def schema(name: str) -> dict:
    doc = openapi_document()
    return {**doc, "$ref": f"#/components/schemas/{name}"}


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema(name))
