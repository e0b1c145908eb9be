"""1,000 concurrent streams on `jaxserve serve` (uvicorn, the default HTTP server) over the
tiny chat model: every stream ends with `data: [DONE]`, the server's thread count stays bounded
(an open stream holds no thread: server/asgi.py) and its memory comes back.

One client process, non-blocking: asyncio streams, one HTTP/1.1 connection per stream. The
server runs 64 sequences at once with a waiting room of 1,000 (admission as configured), so
all 1,000 are accepted and most wait their turn with their connection open. Two rounds: the
first grows whatever the process keeps once grown (the handler pool's threads, allocator
arenas); the second must not grow it further, which a per-stream leak would.
"""

import asyncio
import json
import os
import resource
import subprocess
import sys
import time

import pytest

from http_server import start_server_process

from models.checkpoint import save as save_orbax
from jaxserve.testing.tiny_chat import tiny_chat_model

MODEL = "tiny-chat"
STREAMS = 1000
MAX_NUM_SEQS = 64
HANDLER_THREADS = 64  # --threads (the default): runs handlers; a stream leaves it once accepted
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 240
# Memory bounds, in MiB. Peak: 1,000 open connections with their request state, a little
# over 100 KiB each at most. Growth from the first round's end to the second's: a leak of even
# 16 KiB per stream would show as 16 MiB.
PEAK_MIB = 120
GROWTH_MIB = 12


def _start(path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAXSERVE_FAULTS", None)
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", str(path), "--served-model-name",
           MODEL, "--port", "0", "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-waiting-requests", str(STREAMS), "--max-model-len", "64",
           "--block-size", "16", "--max-num-batched-tokens", "512",
           "--threads", str(HANDLER_THREADS), "--no-structured-outputs"]
    return start_server_process(cmd, env, STARTUP_TIMEOUT_S)


def _status(pid: int) -> tuple[int, int]:
    """(VmRSS in KiB, thread count) of process `pid`."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return int(fields["VmRSS"][0]), int(fields["Threads"][0])


def _dechunk(raw: bytes) -> bytes:
    """A chunked transfer-encoded body, decoded (the server streams SSE that way)."""
    out, i = [], 0
    while True:
        end = raw.index(b"\r\n", i)
        size = int(raw[i:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[end + 2:end + 2 + size])
        i = end + 2 + size + 2


async def _stream(host: str, port: int, i: int, open_: dict) -> tuple[int, list[bytes]]:
    """One streamed completion on its own connection: (status, its SSE data payloads).
    `open_` counts the responses started and not yet ended, and its peak."""
    body = json.dumps({"model": MODEL, "prompt": f"Stream {i} says", "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() +
                     b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        open_["now"] += 1
        open_["peak"] = max(open_["peak"], open_["now"])
        rest = await reader.read()  # to EOF (Connection: close)
        open_["now"] -= 1
    finally:
        writer.close()
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        rest = _dechunk(rest)
    data = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    return status, data


async def _round(url: str, pid: int) -> dict:
    """STREAMS concurrent streams; samples the server's RSS and threads while they run."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    peak = {"rss_kib": 0, "threads": 0}
    done = asyncio.Event()

    async def sample():
        while not done.is_set():
            rss, threads = _status(pid)
            peak["rss_kib"], peak["threads"] = max(peak["rss_kib"], rss), \
                max(peak["threads"], threads)
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    t0 = time.monotonic()
    open_ = {"now": 0, "peak": 0}
    results = await asyncio.gather(*(_stream(host, int(port), i, open_)
                                     for i in range(STREAMS)))
    seconds = time.monotonic() - t0
    done.set()
    await sampler
    return {"results": results, "seconds": seconds, "open": open_["peak"], **peak}


def _settled(pid: int) -> tuple[int, int]:
    """RSS and threads once the last responses' cleanup is done (a short, fixed wait)."""
    time.sleep(1.0)
    return _status(pid)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_orbax(tiny_chat_model(seed=0), tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.mark.timeout(400)
@pytest.mark.subprocess
def test_1000_concurrent_streams_complete_with_bounded_threads_and_memory(tiny_dir):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * STREAMS:  # 1,000 sockets here, 1,000 in the server (which inherits it)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * STREAMS), hard))
    proc, url = _start(tiny_dir)
    try:
        rss0, threads0 = _settled(proc.pid)
        first = asyncio.run(_round(url, proc.pid))
        rss1, threads1 = _settled(proc.pid)
        second = asyncio.run(_round(url, proc.pid))
        rss2, threads2 = _settled(proc.pid)
        figures = {"before": (rss0 // 1024, threads0),
                   "peak 1": (first["rss_kib"] // 1024, first["threads"]),
                   "after 1": (rss1 // 1024, threads1),
                   "peak 2": (second["rss_kib"] // 1024, second["threads"]),
                   "after 2": (rss2 // 1024, threads2),
                   "seconds": (round(first["seconds"], 1), round(second["seconds"], 1)),
                   "open streams": (first["open"], second["open"])}
        print("RSS MiB, threads:", figures)
        for r in (first, second):
            statuses = [s for s, _ in r["results"]]
            assert statuses == [200] * STREAMS, sorted(set(statuses))
            for _, data in r["results"]:
                assert data[-1] == b"[DONE]", data[-3:]
                chunks = [json.loads(d) for d in data[:-1]]
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # Threads: the handler pool, nothing per stream: more responses were open at once
        # than the server has threads (under a WSGI server each would hold one).
        for r in (first, second):
            assert r["threads"] <= threads0 + HANDLER_THREADS + 4, figures
            assert r["open"] > HANDLER_THREADS + 4, figures
        assert threads2 <= threads0 + HANDLER_THREADS + 4, figures
        assert first["rss_kib"] - rss0 < PEAK_MIB * 1024, figures
        assert rss2 - rss1 < GROWTH_MIB * 1024, figures  # the second round kept nothing
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_http_server_option_is_validated():
    from jaxserve.server import ServerConfig
    assert ServerConfig().http_server == "uvicorn"
    assert ServerConfig(http_server="waitress").http_server == "waitress"
    with pytest.raises(ValueError, match="http_server must be one of uvicorn, waitress"):
        ServerConfig(http_server="gunicorn")
