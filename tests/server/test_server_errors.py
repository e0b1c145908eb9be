"""How the server reports a request that fails inside a step, on a tiny random model (token-id
prompts): a 500 error body (inside the stream once it has started), not a hang, while the engine
serves on and frees every block."""

import contextlib
import json
import time

import pytest
import requests

from jaxserve import EngineConfig, LLMEngine
import http_server
from jaxserve.server import EngineLoop, ServerConfig
from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA

MODEL = "tiny"
FAULTY_SEED = 13  # rows with this seed and a prompt starting with 9 fail inside the step


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig(model="tiny", block_size=4, max_num_seqs=4, max_model_len=64,
                               max_num_batched_tokens=32, warmup=False,
                               kv_cache_memory=60 * 4 * TINY_GQA.kv_bytes_per_token(4)),
                  model=random_model(TINY_GQA, seed=2))
    prepare = e._prepare_row

    def faulty(state, item):  # an injected fault, as an unforeseen bug would raise
        if item.seq.sampling_params.seed == FAULTY_SEED and item.seq.prompt_token_ids[0] == 9:
            raise RuntimeError("injected fault")
        return prepare(state, item)

    e._prepare_row = faulty
    return e


@contextlib.contextmanager
def serving(engine):
    loop = EngineLoop(engine).start()
    try:
        with http_server.serving(loop, ServerConfig(served_model_name=MODEL)) as s:
            s.loop = loop
            yield s
    finally:
        loop.stop()


def post(s, body, **kw):
    body = {"model": MODEL, "prompt": [[3, 1, 4, 1, 5], [9, 2, 6]], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True} | body
    return requests.post(s.url + "/v1/completions", data=json.dumps(body), timeout=60, **kw)


def wait_idle(s, engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = s.loop.stats()
        if s.loop.in_flight() == 0 and not st["running"] and not st["waiting"] \
                and st["kv_blocks_free"] == st["kv_blocks_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {s.loop.stats()}, in flight {s.loop.in_flight()}")


def test_request_failing_in_a_step_gives_500_and_serving_goes_on(engine):
    with serving(engine) as s:
        ok = post(s, {})
        assert ok.status_code == 200, ok.text
        want = [c["text"] for c in ok.json()["choices"]]
        # Failing inside a step: a 500 error body, not a hang; the sibling prompt ([3, ...],
        # which does not fail) is aborted with it (wait_idle: nothing left in flight).
        r = post(s, {"seed": FAULTY_SEED, "n": 2, "temperature": 1.0})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "request_failed"
        assert "injected fault" in err["message"]
        # Streaming: the headers are sent, so the error arrives as the stream's last event.
        r = post(s, {"seed": FAULTY_SEED, "temperature": 1.0, "stream": True}, stream=True)
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
        assert events[-1]["error"]["code"] == "request_failed"
        wait_idle(s, engine)
        # The engine serves on, with the same tokens as before.
        again = post(s, {})
        assert again.status_code == 200 and [c["text"] for c in again.json()["choices"]] == want
        wait_idle(s, engine)
