"""The server under faults and overload, over real HTTP on 127.0.0.1.

A request that fails alone (a poisoned logits row, a detokenizer error) gets an OpenAI error
event on its stream or a 500 with the error JSON; every other request gets the text of its solo
run and no block leaks. A dead or stalled engine turns every waiting client's request into a
503 and /health into 503. A burst beyond the queue bound gets 200 or 503 (with Retry-After),
none hangs. Faults are injected with jaxserve/faults.py (a tiny chat model) or with stand-in
engines whose step dies or hangs.
"""

import concurrent.futures as cf
import json
import threading
import time

import pytest
import requests

from jaxserve import EngineConfig, LLMEngine
from jaxserve.faults import EngineThreadDeath
from jaxserve.server import EngineLoop, ServerConfig
from jaxserve.server.engine_loop import WatchdogTimeout
from http_server import serving
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

MODEL = "tiny-chat"
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 128
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "Roses are red,"]
# Request #1 (the first the engine is given) is poisoned at its 41st token, #2's detokenizer
# raises: the module's first test sends them in that order.
FAULTS = "nan_request=#1,nan_at=40,detokenizer_request=#2"


@pytest.fixture(scope="module")
def loop():
    model = tiny_chat_model(seed=0)
    kv = 4 * MAX_NUM_SEQS * MAX_MODEL_LEN * TINY_CHAT.kv_bytes_per_token(4)
    engine = LLMEngine(EngineConfig(model=model.source, warmup=True, max_num_seqs=MAX_NUM_SEQS,
                                    max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                                    block_size=MAX_MODEL_LEN, kv_cache_memory=kv,
                                    structured_outputs=False, faults=FAULTS), model=model)
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def _body(prompt, max_tokens=16, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


def _post(url, body, timeout=60):
    return requests.post(url + "/v1/completions", json=body, timeout=timeout)


def _stream_lines(url, body, first=None):
    lines = []
    with requests.post(url + "/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                lines.append(line[6:])
                if first is not None:
                    first.set()
    return lines


def _wait_idle(loop, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = loop.stats()
        if loop.in_flight() == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] \
                and not s["running"] and not s["waiting"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {loop.stats()}, in flight {loop.in_flight()}")


def test_request_faults_fail_alone(loop):
    with serving(loop, ServerConfig(served_model_name=MODEL)) as s:
        first, poisoned = threading.Event(), {}
        t = threading.Thread(target=lambda: poisoned.update(
            lines=_stream_lines(s.url, _body(PROMPTS[0], max_tokens=100), first)))
        t.start()  # request #1
        assert first.wait(30)
        r2 = _post(s.url, _body(PROMPTS[1]))  # request #2: its detokenizer raises
        with cf.ThreadPoolExecutor(len(PROMPTS) - 2) as pool:
            others = list(pool.map(lambda p: _post(s.url, _body(p)), PROMPTS[2:]))
        t.join(60)
        last = json.loads(poisoned["lines"][-1])  # an error event ends the stream, no [DONE]
        assert last["error"]["type"] == "server_error"
        assert "non-finite logits" in last["error"]["message"]
        assert r2.status_code == 500 and r2.json()["error"]["code"] == "request_failed"
        assert "injected detokenizer fault" in r2.json()["error"]["message"]
        _wait_idle(loop)  # the failed requests' blocks came back
        solo = [_post(s.url, _body(p)).json()["choices"][0]["text"] for p in PROMPTS[2:]]
        assert [r.json()["choices"][0]["text"] for r in others] == solo
        assert requests.get(s.url + "/health", timeout=10).status_code == 200


def test_burst_of_three_times_the_queue_gets_200_or_503(loop):
    waiting = 4
    limit = MAX_NUM_SEQS + waiting  # accepted at once: running slots + waiting queue
    with serving(loop, ServerConfig(served_model_name=MODEL, max_waiting_requests=waiting,
                                    threads=3 * limit + 4)) as s:
        body = _body(PROMPTS[4], max_tokens=64)
        with cf.ThreadPoolExecutor(3 * limit) as pool:
            t0 = time.monotonic()
            rs = list(pool.map(lambda _: _post(s.url, body, timeout=120), range(3 * limit)))
        codes = [r.status_code for r in rs]
        assert set(codes) == {200, 503} and codes.count(200) >= limit, codes
        for r in rs:
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
        texts = {r.json()["choices"][0]["text"] for r in rs if r.status_code == 200}
        assert len(texts) == 1  # the same greedy request: the same text every time
        assert time.monotonic() - t0 < 120
        _wait_idle(loop)
        assert requests.get(s.url + "/health", timeout=10).status_code == 200
        assert _post(s.url, body).status_code == 200


# ---- stand-in engines: admission bookkeeping, a dead thread, a hung step -------------------

class _StandIn:
    """Looks like the engine to the loop; `step` does what the test asks."""

    def __init__(self, real, step):
        self.model, self.max_model_len, self.config = real.model, real.max_model_len, \
            real.config
        self.grammar = None  # serves no structured outputs
        self.profiler = None  # nor profiles
        self.lora = None  # nor LoRA adapters
        self.embeddings = None  # nor embeddings
        self.added, self._step = [], step

    def stats(self):
        return {"kv_blocks_total": 1, "kv_blocks_free": 1, "num_preemptions": 0,
                "num_compiles_after_warmup": 0, "running": 0, "waiting": 0, "block_size": 16,
                "max_model_len": self.max_model_len, "tokens_computed": 0}

    def add_request(self, request_id, prompt, params, priority=0):
        self.added.append((request_id, len(prompt), priority))

    def has_unfinished_requests(self):
        return bool(self.added)

    def abort(self, request_id):
        return True

    def step(self):
        return self._step()


def test_queued_prompt_tokens_bound_and_priority(loop):
    release = threading.Event()
    standin = _StandIn(loop.engine, lambda: release.wait(0.05) and [])
    stand_loop = EngineLoop(standin).start()
    try:
        with serving(stand_loop, ServerConfig(served_model_name=MODEL,
                                              max_waiting_tokens=12)) as s:
            ids = list(range(3, 13))  # 10 prompt tokens
            with cf.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(_post, s.url, _body(ids, priority=-3), 30)
                deadline = time.monotonic() + 10
                while not standin.added and time.monotonic() < deadline:
                    time.sleep(0.02)
                r = _post(s.url, _body(ids[:5]))  # 10 + 5 > 12: refused, nothing queued
                assert r.status_code == 503 and r.headers["Retry-After"] == "1"
                assert "prompt tokens queued" in r.json()["error"]["message"]
                bad = _post(s.url, _body(ids, priority="high"))
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
                assert [(n, p) for _, n, p in standin.added] == [(10, -3)]
                stand_loop.stop(timeout=5)  # the waiting client gets a 503, not a hang
                assert pending.result(30).status_code == 503
    finally:
        stand_loop.stop(timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("kind", ["thread_death", "watchdog"])
def test_dead_or_hung_engine_fails_in_flight_requests(loop, kind):
    if kind == "thread_death":
        def step():
            raise EngineThreadDeath("injected")
        stand_loop, hang = EngineLoop(_StandIn(loop.engine, step)), None
    else:
        hang = threading.Event()
        stand_loop = EngineLoop(_StandIn(loop.engine, lambda: hang.wait(60) and []),
                                watchdog_timeout_s=0.5)
    stand_loop.start()
    try:
        with serving(stand_loop, ServerConfig(served_model_name=MODEL,
                                              disconnect_poll_s=0.1)) as s:
            t0 = time.monotonic()
            lines = _stream_lines(s.url, _body(PROMPTS[0]))
            assert time.monotonic() - t0 < 20  # promptly, not after a client timeout
            err = json.loads(lines[-1])["error"]
            assert err["type"] == "service_unavailable_error", err
            assert requests.get(s.url + "/health", timeout=10).status_code == 503
            assert _post(s.url, _body(PROMPTS[1])).status_code == 503
            assert not stand_loop.alive
            if kind == "watchdog":
                assert isinstance(stand_loop.error, WatchdogTimeout)
    finally:
        if hang is not None:
            hang.set()
        stand_loop.stop(timeout=5)
