"""The tiny engine of jaxserve/testing/engine_state.py served over HTTP with an API key:
shared by the engine-state endpoint tests and the browser tests of the web page."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import requests

from jaxserve.server import EngineLoop, ServerConfig
# The engine and its sizes, as the tests read them (fx.tiny_engine, fx.BLOCK_SIZE, ...).
from jaxserve.testing.engine_state import BLOCK_SIZE, MAX_NUM_SEQS, tiny_engine  # noqa: F401
from http_server import serving

MODEL = "tiny-chat"
KEY = "state-key"
# A prompt of several full blocks: a second request with it hits the prefix cache.
SHARED_PREFIX = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)


def start_loop(engine, **kw) -> EngineLoop:
    return EngineLoop(engine, **kw).start()


def serve(loop, api_key=KEY):
    return serving(loop, ServerConfig(served_model_name=MODEL, api_key=api_key))


def headers(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def get_state(url, key=KEY) -> dict:
    r = requests.get(url + "/v1/engine/state", headers=headers(key), timeout=30)
    r.raise_for_status()
    return r.json()


def fresh_state(url, key=KEY, timeout=10.0) -> dict:
    """A snapshot built after this call started (the endpoint's may be an interval old)."""
    since, deadline = time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = get_state(url, key)
        if snap["monotonic"] >= since:
            return snap
        time.sleep(0.02)
    raise AssertionError(f"no snapshot newer than {timeout}s")


def complete(url, prompt, max_tokens, key=KEY) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(url + "/v1/completions", data=json.dumps(body), headers=headers(key),
                      timeout=120)
    r.raise_for_status()
    return r.json()


def in_background(url, prompts, max_tokens, key=KEY) -> list[threading.Thread]:
    threads = [threading.Thread(target=complete, args=(url, p, max_tokens, key), daemon=True)
               for p in prompts]
    for t in threads:
        t.start()
    return threads


def wait_idle(loop, timeout=60.0) -> dict:
    """Waits until nothing runs and the snapshot says so too (it lags up to one interval)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = loop.engine_state()
        if loop.in_flight() == 0 and not snap["slots"] and not snap["waiting"] \
                and not any(snap["blocks"]["ref_counts"]):
            return snap
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout}s: in flight {loop.in_flight()}")


@contextlib.contextmanager
def held_once(engine, ready, timeout=60.0):
    """Steps `engine` as usual until `ready(engine)` is true after one of its steps, then
    steps it no more until the block exits (or raises): what it holds then stays put for as
    long as the test looks, however slowly the test (or a browser polling the page) runs.

    `ready` is checked on the engine thread right after each step, so nothing can finish
    between the check and the hold. Held, the engine loop keeps iterating (taking commands,
    refreshing its snapshot every interval) but nothing is scheduled, so no request
    progresses, finishes or frees a block. Yields `wait_held()`, to call once the requests
    to hold are sent (AssertionError when not held within `timeout`); on exit the engine
    runs on as before.
    """
    held, release = threading.Event(), threading.Event()

    def gated_step():
        if held.is_set() and not release.wait(0.05):
            return []  # held: the loop comes back in 50 ms (and refreshes its snapshot)
        outputs = step()
        if not release.is_set() and ready(engine):
            held.set()
        return outputs

    def wait_held():
        if not held.wait(timeout):
            raise AssertionError(f"the engine did not become ready to hold in {timeout}s")

    step = engine.step
    engine.step = gated_step  # the engine loop looks it up on every iteration
    try:
        yield wait_held
    finally:
        release.set()
        del engine.step  # the class's method again


def decoding(engine) -> int:
    """How many running requests are past their prefill (engine thread only)."""
    return sum(1 for seq in engine.scheduler.running if not seq.is_prefill)
