"""`jaxserve serve` as a real process: SIGTERM drains in-flight streams, refuses new requests
with 503, and exits 0. The process serves the tiny chat model (jaxserve/testing/tiny_chat.py)
from an orbax save: what is checked is the process's signal handling, not the model."""

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
# Long enough that the stream is still running when SIGTERM arrives, even on a tiny model.
NEW_TOKENS = 200


def _start(path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", str(path), "--served-model-name",
           MODEL, "--port", "0", "--max-num-seqs", "4", "--max-model-len", "256",
           "--max-num-batched-tokens", "32", "--block-size", "256"]
    return start_server_process(cmd, env, STARTUP_TIMEOUT_S)


def _stream(url, result, first_chunk):
    # logprobs: a token whose text is empty (a random model emits special tokens) still gets
    # its chunk, so chunks count tokens.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 1}
    lines = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                lines.append(line[6:])
                first_chunk.set()
    result["lines"] = lines


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_orbax(tiny_chat_model(seed=0), tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.mark.timeout(400)
@pytest.mark.subprocess
def test_sigterm_drains_then_exits(tiny_dir):
    proc, url = _start(tiny_dir)
    try:
        result, first_chunk = {}, threading.Event()
        t = threading.Thread(target=_stream, args=(url, result, first_chunk))
        t.start()
        assert first_chunk.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"},
                          timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
        assert requests.get(url + "/health", timeout=10).status_code == 503
        t.join(120)
        assert result["status"] == 200 and result["lines"][-1] == b"[DONE]"
        chunks = [json.loads(x) for x in result["lines"][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"]) for c in chunks) == NEW_TOKENS  # none lost
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
