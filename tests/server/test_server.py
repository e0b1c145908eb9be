"""The OpenAI-compatible server's HTTP behaviour, over real HTTP on 127.0.0.1.

On a tiny random model with a real (tiny BPE) tokenizer and chat template
(jaxserve/testing/tiny_chat.py): what is checked here is the protocol (validation, errors,
streaming shape, usage, concurrency, aborts), which any model exercises.
tests/e2e/test_server_real_model.py runs the official client against SmolLM2 itself. One engine (and
one engine loop) per module; each test starts an HTTP server (tests/http_server.py) on an
ephemeral port in a thread and talks to it with the official `openai` client, or with raw
`requests` where the point is the exact status and error body.
"""

import concurrent.futures as cf
import json
import time

import openai
import pytest
import requests

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from http_server import serving
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

MODEL = "tiny-chat"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # /metrics too is behind the key
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 128
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "Roses are red,",
           "The largest planet in the solar system is"]
CHAT = [{"role": "user", "content": "Name a colour."}]
LONG = MAX_MODEL_LEN - 24  # new tokens of a request that should stay in flight a while


@pytest.fixture(scope="module")
def engine():
    model = tiny_chat_model(seed=0)
    kv = 4 * MAX_NUM_SEQS * MAX_MODEL_LEN * TINY_CHAT.kv_bytes_per_token(4)
    # One block per sequence and a small token budget: 6 programs to warm up instead of 42
    # (compiling, not running, is what a tiny model's engine spends its time on).
    return LLMEngine(EngineConfig(model=model.source, warmup=True, max_num_seqs=MAX_NUM_SEQS,
                                  max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                                  block_size=MAX_MODEL_LEN, kv_cache_memory=kv), model=model)


@pytest.fixture(scope="module")
def loop(engine):
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def running(loop, **config):
    return serving(loop, ServerConfig(served_model_name=MODEL, **config))


@pytest.fixture(scope="module")
def server(loop):
    with running(loop, api_key=KEY, max_body_bytes=1 << 16) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, headers=headers, timeout=120, **kw)


def wait_idle(loop, free_blocks, timeout=30.0):
    """Waits until nothing is in flight and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = loop.stats()
        if loop.in_flight() == 0 and s["kv_blocks_free"] == free_blocks and not s["running"]:
            return s
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout}s: {loop.stats()}, "
                         f"in flight {loop.in_flight()}")


def stream_text(client, **kw):
    """Streams a completion; returns the text per choice index and the chunks."""
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    return texts, chunks


def metric(server, name):
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# ---- the OpenAI client, end to end ---------------------------------------------------------

def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    for name in ("jaxserve_time_to_first_token_seconds_bucket",
                 "jaxserve_inter_token_latency_seconds_bucket",
                 "jaxserve_e2e_request_latency_seconds_bucket", "jaxserve_num_requests_running",
                 "jaxserve_num_requests_waiting", "jaxserve_kv_cache_usage_ratio",
                 "jaxserve_num_preemptions_total", "jaxserve_prompt_tokens_total",
                 "jaxserve_generation_tokens_total", "jaxserve_compiles_after_warmup_total",
                 "jaxserve_prefix_cache_queries_tokens_total",
                 "jaxserve_prefix_cache_hits_blocks_total", "jaxserve_prefix_cache_blocks",
                 "jaxserve_kv_cow_copies_total"):
        assert name in text, name


def test_completion_stream_equals_non_stream_and_usage(client, engine):
    tok = engine.model.tokenizer
    prompt_len = len(tok.encode(PROMPTS[0])) + (1 if tok.add_bos else 0)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == prompt_len + 12
    texts, chunks = stream_text(client, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True},
                                stream_options={"include_usage": True})
    assert texts[0] == out.choices[0].text and texts[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_chat_stream_and_non_stream(client, engine):
    tok = engine.model.tokenizer
    prompt_len = len(tok.encode(tok.apply_chat_template(CHAT))) + (1 if tok.add_bos else 0)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                         temperature=0)
    msg = out.choices[0].message
    assert out.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.total_tokens == prompt_len + out.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        out.choices[0].finish_reason


def test_n_choices_and_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=7, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each branch has its own stream: the choices differ
    assert a.usage.completion_tokens == 3 * 12 or any(c.finish_reason == "stop"
                                                      for c in a.choices)
    streamed, _ = stream_text(client, prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                              seed=7, n=3)
    assert [streamed[i] for i in range(3)] == texts
    other = client.completions.create(**{**kw, "seed": 8})
    assert [c.text for c in sorted(other.choices, key=lambda c: c.index)] != texts


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    cut = full[:full.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                    temperature=0, stop=[stop, "@@never@@"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    texts, _ = stream_text(client, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop)
    assert texts[0] == cut


def test_logprobs_echo_token_ids_and_batches(client, engine):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob == pytest.approx(max(top.values())) and logprob <= 0
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 2 for c in content)
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, echo=True,
                                     temperature=0)
    assert echo.choices[0].text.startswith(PROMPTS[1])
    ids = engine.model.tokenizer.encode(PROMPTS[0])
    batch = client.completions.create(model=MODEL, prompt=[ids, PROMPTS[3]], max_tokens=4,
                                      temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]
    assert by_index[0] == out.choices[0].text[:len(by_index[0])]


def test_32_concurrent_streams_match_solo_runs(client, loop):
    free = loop.stats()["kv_blocks_free"]
    kw = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    solo = [client.completions.create(model=MODEL, prompt=p, **kw).choices[0].text
            for p in PROMPTS]
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: stream_text(client, prompt=p, **kw)[0][0], jobs))
    assert got == [solo[i % len(PROMPTS)] for i in range(32)]
    wait_idle(loop, free)


def _drop_after(url, body, chunks_before_drop):
    """Streams with raw requests; closes the connection after some chunks (or reads all)."""
    seen = 0
    with requests.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                seen += 1
                if line == b"data: [DONE]":
                    return "done", seen
                if chunks_before_drop is not None and seen >= chunks_before_drop:
                    return "dropped", seen  # leaving the with-block closes the socket
    return "eof", seen


def test_dropped_streams_free_their_blocks(server, loop):
    free = wait_idle(loop, loop.stats()["kv_blocks_total"])["kv_blocks_free"]
    finished_before = metric(server, 'jaxserve_request_total{finish_reason="length"}')
    # Long streams: the tiny model writes tokens fast, and a dropped stream must still be
    # running when the server notices its client is gone.
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with cf.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: _drop_after(server.url + "/v1/completions", body,
                                                      3 if i % 2 else None), range(20)))
    assert [r[0] for r in results] == ["done", "dropped"] * 10
    wait_idle(loop, free)
    # Only the 10 streams read to the end finished: the dropped ones were aborted mid-way.
    finished = metric(server, 'jaxserve_request_total{finish_reason="length"}')
    assert finished - finished_before == 10
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_overload_gives_503_not_500(loop):
    free = loop.stats()["kv_blocks_free"]
    with running(loop, max_waiting_requests=2) as s:
        body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True}
        with cf.ThreadPoolExecutor(24) as pool:
            rs = list(pool.map(lambda _: post(s, "/v1/completions", body, key=None), range(24)))
        codes = [r.status_code for r in rs]
        assert set(codes) == {200, 503}, codes
        assert codes.count(200) >= MAX_NUM_SEQS + 2
        err = next(r.json()["error"] for r in rs if r.status_code == 503)
        assert err["type"] == "service_unavailable_error" and err["code"] == "queue_full"
        wait_idle(loop, free)
        assert post(s, "/v1/completions", body, key=None).status_code == 200


# ---- validation: every bad input is a clear 4xx, never a 500 -------------------------------

def C(**kw):  # a completions body
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def H(**kw):  # a chat body
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **kw}


def ids(n):  # n valid token ids (the tiny vocabulary has 256)
    return [3 + i % 250 for i in range(n)]


CMP, CHT = "/v1/completions", "/v1/chat/completions"
BAD = "invalid_request_error"
CASES = [  # (id, path, body, status, error type, param)
    ("bad-json", CMP, b'{"model": "tiny-chat", "prompt": ', 400, BAD, None),
    ("not-an-object", CMP, [1, 2], 400, BAD, None),
    ("missing-model", CMP, {"prompt": "x"}, 400, BAD, "model"),
    ("unknown-model", CMP, C(model="gpt-4"), 404, "not_found_error", "model"),
    ("missing-prompt", CMP, {"model": MODEL}, 400, BAD, "prompt"),
    ("empty-prompt", CMP, C(prompt=""), 400, BAD, "prompt"),
    ("empty-prompt-list", CMP, C(prompt=[]), 400, BAD, "prompt"),
    ("prompt-wrong-type", CMP, C(prompt=12), 400, BAD, "prompt"),
    ("token-id-negative", CMP, C(prompt=[1, -5]), 400, BAD, "prompt"),
    ("token-id-over-vocab", CMP, C(prompt=[[1, 10 ** 9]]), 400, BAD, "prompt"),
    ("prompt-too-long", CMP, C(prompt=ids(MAX_MODEL_LEN + 87)), 400, BAD, "prompt"),
    ("prompt-plus-max-tokens", CMP, C(prompt=ids(MAX_MODEL_LEN - 13), max_tokens=50), 400,
     BAD, "max_tokens"),
    ("max-tokens-zero", CMP, C(max_tokens=0), 400, BAD, "max_tokens"),
    ("max-tokens-string", CMP, C(max_tokens="5"), 400, BAD, "max_tokens"),
    ("temperature-negative", CMP, C(temperature=-0.5), 400, BAD, "temperature"),
    ("temperature-nan", CMP, b'{"model": "tiny-chat", "prompt": "x", "temperature": NaN}',
     400, BAD, "temperature"),
    ("temperature-inf", CHT, b'{"model": "tiny-chat", "messages": [{"role": "user", '
     b'"content": "x"}], "temperature": Infinity}', 400, BAD, "temperature"),
    ("top-p-zero", CMP, C(top_p=0), 400, BAD, "top_p"),
    ("top-p-over-one", CHT, H(top_p=1.5), 400, BAD, "top_p"),
    ("top-k-below-minus-one", CMP, C(top_k=-2), 400, BAD, "top_k"),
    ("n-zero", CMP, C(n=0), 400, BAD, "n"),
    ("n-over-limit", CHT, H(n=1000), 400, BAD, "n"),
    ("logprobs-over-20", CMP, C(logprobs=21), 400, BAD, "logprobs"),
    ("top-logprobs-over-20", CHT, H(logprobs=True, top_logprobs=21), 400, BAD, "top_logprobs"),
    ("too-many-stops", CMP, C(stop=[f"s{i}" for i in range(40)]), 400, BAD, "stop"),
    ("stop-too-long", CMP, C(stop="x" * 1000), 400, BAD, "stop"),
    ("stop-wrong-type", CMP, C(stop=[1]), 400, BAD, "stop"),
    ("tool-without-name", CHT, H(tools=[{"type": "function", "function": {}}]), 400, BAD,
     "tools"),
    ("suffix", CMP, C(suffix="end"), 400, BAD, "suffix"),
    ("best-of", CMP, C(best_of=3), 400, BAD, "best_of"),
    ("stream-wrong-type", CMP, C(stream="yes"), 400, BAD, "stream"),
    ("stream-options-without-stream", CMP, C(stream_options={"include_usage": True}), 400,
     BAD, "stream_options"),
    ("penalty-out-of-range", CMP, C(presence_penalty=5), 400, BAD, "presence_penalty"),
    ("min-tokens-over-max", CMP, C(min_tokens=10), 400, BAD, "min_tokens"),
    ("messages-empty", CHT, H(messages=[]), 400, BAD, "messages"),
    ("messages-bad-role", CHT, H(messages=[{"role": "wizard", "content": "x"}]), 400, BAD,
     "messages"),
    ("messages-image-part", CHT, H(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, BAD, "messages"),
    ("top-logprobs-without-logprobs", CHT, H(top_logprobs=2), 400, BAD, "top_logprobs"),
    ("body-too-large", CMP, C(prompt="x" * 100_000), 413, BAD, None),
]


@pytest.mark.parametrize("path,body,status,etype,param", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_validation(server, path, body, status, etype, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert len(r.text) < 600  # the error never echoes the (possibly huge) input


def test_auth_routes_and_serving_after_errors(server, client):
    r = post(server, CMP, C(), key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(server, CMP, C(), key="wrong").status_code == 401
    assert requests.get(server.url + "/health", timeout=10).status_code == 200  # open
    r = requests.get(server.url + "/v1/nope", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    # After the whole validation table the engine still serves.
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert metric(server, "jaxserve_compiles_after_warmup_total") == 0
    assert metric(server, 'jaxserve_http_errors_total{status="400"}') >= 30


def test_embeddings_need_enable_embeddings(server):
    """This engine was started without enable_embeddings: the route answers a 400 that says
    how to get them (tests/server/test_embeddings_server.py serves them)."""
    r = post(server, "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported" and "--enable-embeddings" in error["message"]


# ---- a dead engine -------------------------------------------------------------------------

class _FailingEngine:
    """Looks like the engine to the server; its step raises, as a device failure would."""

    def __init__(self, real):
        self.model, self.max_model_len, self.config = real.model, real.max_model_len, \
            real.config
        self.grammar = None  # serves no structured outputs
        self.profiler = None  # nor profiles
        self.lora = None  # nor LoRA adapters
        self.embeddings = None  # nor embeddings
        self._pending = False

    def stats(self):
        return {"kv_blocks_total": 1, "kv_blocks_free": 1, "num_preemptions": 0,
                "num_compiles_after_warmup": 0, "running": 0, "waiting": 0, "block_size": 16,
                "max_model_len": self.max_model_len}

    def add_request(self, request_id, prompt, params):
        self._pending = True

    def has_unfinished_requests(self):
        return self._pending

    def step(self):
        raise RuntimeError("device lost")


def test_dead_engine_gives_503(engine):
    loop = EngineLoop(_FailingEngine(engine)).start()
    with running(loop) as s:
        assert requests.get(s.url + "/health", timeout=10).status_code == 200
        r = post(s, CMP, C(), key=None)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert requests.get(s.url + "/health", timeout=10).status_code == 503
        assert post(s, CMP, C(), key=None).status_code == 503
    loop.stop()
