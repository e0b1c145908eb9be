"""Per-request limits: every bad input of the server's table (tests/server/test_server.py CASES)
and a few more limits get a clear 4xx in the OpenAI error shape, naming the field, and no error
message echoes more of the client's input than a short repr (errors.MAX_SHOWN_CHARS). Flask's
test client; nothing here generates, so no step compiles."""

import json

import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app
from jaxserve.server.errors import MAX_SHOWN_CHARS
from test_server import CASES, MODEL
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

CMP = "/v1/completions"
WINDOW = MAX_SHOWN_CHARS + 8  # a repr's quotes and a field name's worth of slack


def C(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


MORE = [  # (id, path, body, status, param)
    ("n-over-batch-slots", CMP, C(prompt=["a", "b"], n=4), 400, "n"),
    ("priority-over-range", CMP, C(priority=2 ** 40), 400, "priority"),
    ("priority-wrong-type", CMP, C(priority="high"), 400, "priority"),
    ("model-name-huge", CMP, C(model="m" * 5000), 404, "model"),
    ("include-usage-huge", CMP, C(stream=True, stream_options={"include_usage": "x" * 500}),
     400, "include_usage"),
    ("max-tokens-over-context", CMP, C(max_tokens=10 ** 30), 400, "max_tokens"),
    ("deeply-nested-json", CMP, b"[" * 100_000 + b"]" * 100_000, 413, None),
]


@pytest.fixture(scope="module")
def client():
    model = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(
        model=model.source, warmup=False, max_num_seqs=2, max_model_len=128,
        max_num_batched_tokens=16, block_size=128, structured_outputs=False,
        kv_cache_memory=4 * 128 * TINY_CHAT.kv_bytes_per_token(4)), model=model)
    loop = EngineLoop(engine).start()
    yield create_app(loop, ServerConfig(served_model_name=MODEL,
                                        max_body_bytes=1 << 16)).test_client()
    loop.stop()


def _client_strings(value):
    """Every string the client sent, and the repr of every list (token ids echo as one)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        yield repr(value)
        for v in value:
            yield from _client_strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _client_strings(v)


def _echoed(message: str, body) -> str | None:
    """A piece of client input longer than WINDOW that the message repeats, if any."""
    if isinstance(body, bytes):
        texts = [body.decode("latin-1")]
    else:
        texts = list(_client_strings(body))
    for text in texts:
        for i in range(0, max(0, len(text) - WINDOW) + 1):
            piece = text[i:i + WINDOW]
            if len(piece) == WINDOW and piece in message:
                return piece
    return None


@pytest.mark.parametrize("path,body,status,param",
                         [(c[1], c[2], c[3], c[5]) for c in CASES] + [m[1:] for m in MORE],
                         ids=[c[0] for c in CASES] + [m[0] for m in MORE])
def test_bad_input_gets_a_short_clear_error(client, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body)
    r = client.post(path, data=data, content_type="application/json")
    assert 400 <= r.status_code < 500, r.get_data(as_text=True)[:300]
    if not any(c[2] is body for c in CASES):  # the table's own statuses: test_server.py
        assert (r.status_code, r.get_json()["error"]["param"]) == (status, param)
    err = r.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert _echoed(err["message"], body) is None, err["message"]
