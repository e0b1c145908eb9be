"""`jaxserve serve --data-parallel-size N` as a user runs it: a local Ray cluster started for the
command, the HTTP app in front, a clean exit on SIGTERM; bad flags refused before Ray starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from jaxserve.testing.tiny_chat import tiny_chat_model
from models.checkpoint import save as save_orbax

MODEL = "tiny-chat"
STARTUP_TIMEOUT_S = 300


def _cmd(path, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxserve.cli", "serve", str(path), "--served-model-name",
            MODEL, "--port", "0", "--max-num-seqs", "4", "--max-model-len", "128",
            "--max-num-batched-tokens", "32", "--block-size", "128", "--no-structured-outputs",
            *extra]


@pytest.mark.parametrize("extra, message", [
    (("--data-parallel-size", "0"), "--data-parallel-size must be a positive integer"),
    (("--data-parallel-size", "2", "--coordinator-address", "127.0.0.1:1234"),
     "does not take --coordinator-address"),
])
def test_bad_replica_flags_are_refused_before_ray_starts(extra, message):
    # No model is loaded and no Ray is started: the flags are checked first.
    out = subprocess.run(_cmd("/nonexistent", *extra), capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.subprocess
@pytest.mark.timeout(600)
def test_serve_with_one_replica_answers_through_ray_and_exits_cleanly(tmp_path):
    pytest.importorskip("ray")
    path = save_orbax(tiny_chat_model(seed=0), tmp_path / "ckpt")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, stopped with the command
    proc = subprocess.Popen(_cmd(path, "--data-parallel-size", "1", "--replica-cpus", "0.5"),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            text=True)
    try:
        url, deadline = None, time.monotonic() + STARTUP_TIMEOUT_S
        for line in proc.stdout:
            if "listening on " in line:
                url = line.split("listening on ")[1].strip()
                break
            if time.monotonic() > deadline:
                break
        assert url is not None, f"the server did not start (rc={proc.poll()})"
        r = requests.post(url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert r.headers["x-jaxserve-replica"] == "replica-0"
        health = requests.get(url + "/health", timeout=10)
        assert health.json() == {"status": "ok", "replicas": {"replica-0": "healthy"}}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
