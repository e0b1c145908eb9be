"""A jaxserve server on 127.0.0.1 in a child process, for the load scripts (stress, soak).

Run directly, it builds the engine and serves it (`serve` of jaxserve.server, SIGTERM drains):

    .venv/bin/python scripts/loopback_server.py --model tiny --port 0

`start(...)` (used by scripts/stress_server.py and scripts/soak.py) runs that in a child
process, waits for its "listening" line and /health, and yields its URL and pid: the server
is a separate process, so its RSS is the server's alone and a crash shows as an exit code.
`--model tiny` is the tests' random TINY_CHAT model with its tiny BPE tokenizer (no download,
compiles in seconds); any other value is a model name or path `LLMEngine` loads (e.g.
smollm2-135m).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (http://\S+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """What the child serves: the model and the engine/server limits the load needs."""

    model: str = "tiny"
    max_num_seqs: int = 16
    max_model_len: int = 256
    threads: int = 256  # every open stream holds a WSGI thread
    max_waiting_requests: int = 512
    prefix_caching: bool = True

    def args(self) -> list[str]:
        return ["--model", self.model, "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--threads", str(self.threads),
                "--max-waiting-requests", str(self.max_waiting_requests),
                "--prefix-caching" if self.prefix_caching else "--no-prefix-caching"]


@dataclasses.dataclass(frozen=True)
class Running:
    url: str
    pid: int
    proc: subprocess.Popen

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()


def _read_url(proc: subprocess.Popen, timeout: float, log: list[str]) -> str:
    found: dict[str, str] = {}
    done = threading.Event()

    def pump():  # keeps draining the child's output so it never blocks on a full pipe
        for line in proc.stdout:
            log.append(line.rstrip())
            del log[:-200]
            m = LISTENING.search(line)
            if m and "url" not in found:
                found["url"] = m.group(1)
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    if not done.wait(timeout) or "url" not in found:
        raise RuntimeError(f"the server did not start within {timeout:.0f}s (exit code "
                           f"{proc.poll()}); its last output:\n" + "\n".join(log[-30:]))
    return found["url"]


@contextlib.contextmanager
def start(spec: ServerSpec, startup_timeout: float = 600.0, stop_timeout: float = 90.0):
    """Runs the server for the block; yields `Running`. SIGTERM (drain) at the end."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, __file__, "--port", "0", *spec.args()],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO)
    log: list[str] = []
    try:
        url = _read_url(proc, startup_timeout, log)
        deadline = time.monotonic() + 60
        while requests.get(url + "/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the server never reported healthy")
            time.sleep(0.2)
        yield Running(url=url, pid=proc.pid, proc=proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def engine_gauges(url: str) -> dict:
    """running, waiting, kv_blocks_in_use, ... from /v1/engine/state (refreshed every 0.2 s)."""
    return requests.get(url + "/v1/engine/state", timeout=30).json()["gauges"]


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    """The engine's gauges once nothing runs, waits or holds a block (or the last seen)."""
    deadline = time.monotonic() + timeout
    while True:
        g = engine_gauges(url)
        if (g["running"] == 0 and g["waiting"] == 0 and g["kv_blocks_in_use"] == 0) or \
                time.monotonic() > deadline:
            return g
        time.sleep(0.25)


# ---- the child: build the engine and serve -------------------------------------------------

def _build_engine(args):
    from jaxserve import EngineConfig, LLMEngine
    # No structured outputs: the load sends none, and their masked programs compile on a
    # background thread after start-up, which a SIGTERM soon after a cold start waits for
    # (the process then outlives the stop timeout).
    common = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  enable_prefix_caching=args.prefix_caching, warmup=True,
                  structured_outputs=False)
    if args.model != "tiny":
        return LLMEngine(EngineConfig(model=args.model, **common)), args.model
    from models.model import enable_compilation_cache
    from jaxserve.testing.tiny_chat import tiny_chat_model
    enable_compilation_cache()  # load_model does this for named models; a restart reuses it
    model = tiny_chat_model(seed=0)
    kv = 4 * args.max_num_seqs * args.max_model_len * model.config.kv_bytes_per_token(4)
    return LLMEngine(EngineConfig(model=model.source, kv_cache_memory=kv, **common),
                     model=model), "tiny-chat"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--max-waiting-requests", type=int, default=512)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    from jaxserve.server import ServerConfig, serve
    engine, name = _build_engine(args)
    config = ServerConfig(served_model_name=name, threads=args.threads,
                          max_waiting_requests=args.max_waiting_requests)
    return serve(engine, "127.0.0.1", args.port, config)


if __name__ == "__main__":
    sys.exit(main())
