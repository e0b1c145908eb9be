"""`jaxserve serve` as a real process under faults: a step that raises or hangs (watchdog)
ends every in-flight stream with an error event and the process with a non-zero status (so a
supervisor's Restart=on-failure restarts it); SIGTERM under load finishes every in-flight
stream, then exits 0. Faults come from $JAXSERVE_FAULTS (jaxserve/faults.py); the model is the
tiny chat model saved with orbax, as in test_server_drain.py."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from http_server import start_server_process
from models.checkpoint import save as save_orbax
from jaxserve.testing.tiny_chat import tiny_chat_model

MODEL = "tiny-chat"
STARTUP_TIMEOUT_S = 240
NEW_TOKENS = 200
STREAMS = 16


def _start(path, faults=None, *extra) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAXSERVE_FAULTS", None)
    if faults:
        env["JAXSERVE_FAULTS"] = faults
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", str(path), "--served-model-name",
           MODEL, "--port", "0", "--max-num-seqs", "4", "--max-model-len", "256",
           "--max-num-batched-tokens", "32", "--block-size", "256", "--no-structured-outputs",
           *extra]
    return start_server_process(cmd, env, STARTUP_TIMEOUT_S)


def _stream(url, result, started):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 1}
    lines = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                lines.append(line[6:])
                started.set()
    result["lines"] = lines


def _streams(url, n):
    results = [{} for _ in range(n)]
    events = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(url, r, e))
               for r, e in zip(results, events)]
    for t in threads:
        t.start()
    return results, events, threads


def _metric(url, name) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0  # a labelled counter appears with its first increment


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_orbax(tiny_chat_model(seed=0), tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.mark.timeout(400)
@pytest.mark.subprocess
@pytest.mark.parametrize("faults,extra,code", [
    ("step_raise=40", (), "engine_unavailable"),
    ("step_stall=40,stall_s=120", ("--watchdog-timeout", "2"), "engine_unavailable"),
], ids=["step-raises", "step-hangs-watchdog"])
def test_engine_failure_errors_every_stream_and_exits_nonzero(tiny_dir, faults, extra, code):
    proc, url = _start(tiny_dir, faults, *extra)
    try:
        results, started, threads = _streams(url, 3)
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        assert time.monotonic() - t0 < 60  # nobody waits for a client timeout
        for r in results:
            assert r["status"] == 200
            err = json.loads(r["lines"][-1])["error"]  # an error event, no [DONE]
            assert err["type"] == "service_unavailable_error" and err["code"] == code
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(400)
@pytest.mark.subprocess
def test_sigterm_under_load_finishes_every_stream(tiny_dir):
    proc, url = _start(tiny_dir)
    try:
        results, started, threads = _streams(url, STREAMS)  # 4 running, the rest waiting
        deadline = time.monotonic() + 60
        while True:  # until every stream was accepted (some may have finished already)
            in_flight = requests.get(url + "/v1/engine/state", timeout=10).json()[
                "server"]["in_flight"]
            if in_flight + _metric(url, 'jaxserve_request_total{finish_reason="length"}') \
                    >= STREAMS:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert in_flight >= 4  # a batch and more are in flight when the signal comes
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        for r in results:
            assert r["status"] == 200 and r["lines"][-1] == b"[DONE]"
            chunks = [json.loads(x) for x in r["lines"][:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(len(c["choices"]) for c in chunks) == NEW_TOKENS  # none lost
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
