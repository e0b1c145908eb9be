"""Two engine replicas on a local Ray Serve cluster behind the HTTP app (jaxserve/distributed/).

One module, one cluster, one pool (their start-up is most of the cost): greedy outputs equal
one engine's, both replicas serve, shared prefixes stick to the replica that cached them, and a
replica killed mid-stream fails only its own streams, comes back and serves again, with no KV
block leaked anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest
import msgspec
import requests
import zmq

ray = pytest.importorskip("ray")

from http_server import serving  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.distributed.launch import ReplicaOptions, start_pool, stop_pool  # noqa: E402
from jaxserve.distributed.ray_cluster import RayCluster  # noqa: E402
from jaxserve.engine import LLMEngine  # noqa: E402
from jaxserve.server import ServerConfig  # noqa: E402
from jaxserve.testing.tiny_chat import tiny_chat_model  # noqa: E402
from models.checkpoint import save as save_orbax  # noqa: E402

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(900)]

MODEL = "tiny-chat"
BLOCK = 16
ENGINE = {"max_num_seqs": 4, "max_model_len": 256, "block_size": BLOCK, "warmup": False,
          "structured_outputs": False}
RESTART_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_orbax(tiny_chat_model(seed=0), tmp_path_factory.mktemp("tiny") / "ckpt"))


def _free_port_pair() -> int:
    """A port P with P and P + 1 free now (replica K publishes KV events on P + K)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def events_port():
    return _free_port_pair()


@pytest.fixture(scope="module")
def pool(ckpt, events_port):
    config = ServerConfig(served_model_name=MODEL)
    with RayCluster(num_cpus=2):
        # "*": each replica binds (a host names a router to connect to, as in vLLM).
        p = start_pool({"model": ckpt, **ENGINE, "kv_events_endpoint": f"tcp://*:{events_port}"},
                       ReplicaOptions(num_replicas=2, num_cpus=0.5, health_check_period_s=1.0),
                       capacity=ENGINE["max_num_seqs"] + config.max_waiting_requests)
        try:
            _wait(lambda: all(r["pid"] for r in p.replicas().values()), 60, "first polls")
            with serving(p, config) as server:
                yield p, server
        finally:
            stop_pool(p)


@pytest.fixture(scope="module")
def reference(ckpt):
    """One engine in this process, same checkpoint and limits: the outputs to match."""
    engine = LLMEngine(EngineConfig(model=ckpt, **ENGINE))

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[str]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(f"ref-{time.monotonic_ns()}-{i}", ids, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        tok = engine.model.tokenizer
        return [[tok.decode([t]) for t in done[k]]
                for k in sorted(done, key=lambda k: int(k.rsplit("-", 1)[1]))]
    return greedy


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[list[str], str]:
    """The generated tokens (as the server names them in logprobs) and the serving replica."""
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"], r.headers["x-jaxserve-replica"]


def _prompt(seed: int, n: int, prefix: list[int] = ()) -> list[int]:
    return list(prefix) + [(seed * 37 + 11 * i) % 200 + 20 for i in range(n)]


def _replica_stats(pool) -> dict[str, dict]:
    return pool.stats()["replicas"]


# ---- tests ---------------------------------------------------------------------------------

def test_outputs_equal_one_engine_and_both_replicas_serve(pool, reference):
    _, server = pool
    prompts = [_prompt(seed, 20) for seed in range(6)]
    got = [_complete(server.url, p) for p in prompts]
    assert [tokens for tokens, _ in got] == reference(prompts, 8)
    assert {replica for _, replica in got} == {"replica-0", "replica-1"}
    # The web page's engine view shows one replica's engine, named.
    view = requests.get(server.url + "/v1/engine/state", timeout=30)
    assert view.status_code == 200, view.text
    assert view.json()["replica"] in {"replica-0", "replica-1"}
    assert view.json()["blocks"]["block_size"] == BLOCK


def test_shared_prefixes_land_on_the_replica_that_cached_them(pool):
    p, server = pool
    before = {n: s["prefix_cache_hits_blocks"] for n, s in _replica_stats(p).items()}
    prefixes = {name: _prompt(100 + i, 4 * BLOCK) for i, name in enumerate("ab")}
    first = {name: _complete(server.url, _prompt(0, 5, prefix))[1]
             for name, prefix in prefixes.items()}
    placed = {name: [_complete(server.url, _prompt(user, 5, prefix))[1] for user in (1, 2, 3)]
              for name, prefix in prefixes.items()}
    for name in prefixes:
        assert placed[name] == [first[name]] * 3, (name, first, placed)
    time.sleep(1.5)  # the pool's pollers refresh each replica's stats
    after = {n: s["prefix_cache_hits_blocks"] for n, s in _replica_stats(p).items()}
    for name in prefixes:  # three later users of each prefix hit its 4 cached blocks
        replica = first[name]
        others = sum(1 for n in prefixes if first[n] == replica)
        assert after[replica] - before[replica] >= 3 * 4 * others


def _stream(url: str, prompt: list[int], result: dict, started: threading.Event,
            max_tokens: int = 120) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    events = []
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=180) as r:
            result["status"], result["replica"] = r.status_code, \
                r.headers.get("x-jaxserve-replica")
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    events.append(line[6:])
                    started.set()
    except requests.RequestException as e:
        result["exception"] = repr(e)
    started.set()
    result["events"] = events


def _tokens(events: list[bytes]) -> list[str]:
    out = []
    for e in events:
        if e != b"[DONE]" and "error" not in json.loads(e):
            lp = json.loads(e)["choices"][0]["logprobs"]
            out.extend(lp["tokens"] if lp else [])
    return out


def test_a_killed_replica_fails_only_its_streams_and_comes_back(pool, reference):
    p, server = pool
    prefixes = [_prompt(300 + i, 2 * BLOCK) for i in range(2)]
    homes = [_complete(server.url, prefix + [5])[1] for prefix in prefixes]
    # Two new prefixes on idle replicas: the router's tie-break rotation splits them.
    assert homes[0] != homes[1], homes
    victim = homes[0]
    try:
        _kill_mid_stream(p, server, prefixes, victim, reference)
    finally:  # a failure above must not leave the next tests a pool with one replica down
        _wait(lambda: p.replicas()[victim]["healthy"], RESTART_TIMEOUT_S,
              "the replica's restart")
    assert requests.get(server.url + "/health", timeout=10).json()["replicas"] == {
        "replica-0": "healthy", "replica-1": "healthy"}
    served = set()
    for seed in range(8):  # the router spreads unrelated prompts over both again
        served.add(_complete(server.url, _prompt(400 + seed, 12))[1])
    assert victim in served
    # No blocks leaked: every replica's cache is all free once nothing runs.
    time.sleep(1.5)
    for name, s in _replica_stats(p).items():
        assert (s["running"], s["waiting"]) == (0, 0), name
        assert s["kv_blocks_in_use"] == 0, (name, s["kv_blocks_in_use"])


def _kill_mid_stream(p, server, prefixes, victim, reference) -> None:
    # prompts[:2] share the victim's cached prefix, prompts[2:] the other replica's.
    prompts = [prefix + [7 + i] for prefix in prefixes for i in range(2)]
    # As long as max_model_len allows: the victim's streams must still be running when it
    # is killed, however long the other replica takes to start its own.
    max_tokens = ENGINE["max_model_len"] - len(prompts[0]) - 8
    results = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(server.url, q, r, s, max_tokens))
               for q, r, s in zip(prompts, results, started)]
    for t in threads:
        t.start()
    for s in started[:2]:  # kill once the victim's own streams run, not the others'
        assert s.wait(120)
    os.kill(p.replicas()[victim]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(200)
        assert not t.is_alive(), "a stream hung"
    assert [r["replica"] == victim for r in results] == [True, True, False, False]
    expected = reference(prompts, max_tokens)
    for prompt, result, want in zip(prompts, results, expected):
        assert result["status"] == 200 and "exception" not in result, result
        if result["replica"] == victim:
            assert result["events"][-1] != b"[DONE]", "a victim's stream ended before the kill"
            last = json.loads(result["events"][-1])
            assert last["error"]["code"] == "replica_unavailable", last
        else:
            assert result["events"][-1] == b"[DONE]"
            assert _tokens(result["events"]) == want
    # While the victim restarts: the pool is healthy and routes around it.
    health = requests.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    tokens, replica = _complete(server.url, _prompt(7, 10))
    assert replica != victim or p.replicas()[victim]["healthy"]


def test_pool_metrics_are_the_replicas_sums_under_load(pool):
    p, server = pool
    prompts = [_prompt(500 + i, 10) for i in range(4)]
    results, started = [{} for _ in prompts], [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(server.url, q, r, s, 240))
               for q, r, s in zip(prompts, results, started)]
    for t in threads:
        t.start()
    try:
        for s in started:
            assert s.wait(120)
        # Scrape until a poll of the replicas saw the streams running (the pool polls each
        # every 0.5 s); the checks below hold within any one scrape.
        while True:
            families = {f.name: f for f in text_string_to_metric_families(
                requests.get(server.url + "/metrics", timeout=30).text)}
            if families["vllm:num_requests_running"].samples[0].value > 0 or \
                    not any(t.is_alive() for t in threads):
                break
            time.sleep(0.05)
    finally:
        for t in threads:
            t.join(200)

    def by_replica(name):
        return {s.labels["replica"]: s.value for s in families[name].samples}
    running = by_replica("jaxserve_replica_num_requests_running")
    assert set(running) == {"replica-0", "replica-1"}
    assert families["vllm:num_requests_running"].samples[0].value == sum(running.values()) > 0
    assert families["vllm:num_requests_waiting"].samples[0].value == \
        sum(by_replica("jaxserve_replica_num_requests_waiting").values())
    info = families["vllm:cache_config_info"].samples[0].labels
    totals = [s["kv_blocks_total"] for s in _replica_stats(p).values()]
    assert int(info["block_size"]) == BLOCK and int(info["num_gpu_blocks"]) == sum(totals)
    assert by_replica("jaxserve_replica_up") == {"replica-0": 1.0, "replica-1": 1.0}


def test_each_replica_publishes_kv_events_on_its_own_port(pool, events_port):
    p, server = pool
    ctx = zmq.Context()
    subs = []
    try:
        for rank in (0, 1):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            sub.connect(f"tcp://127.0.0.1:{events_port + rank}")
            subs.append(sub)
        time.sleep(1.0)  # PUB/SUB: a subscription takes a moment to reach the publisher
        served = {}
        for seed in range(600, 640):  # until each replica served a 3-block prompt
            # Token 3 first: no earlier test cached a block of these (_prompt repeats its
            # tokens every 200 seeds), so each of the 3 blocks is newly stored.
            prompt = _prompt(seed, 3 * BLOCK, prefix=[3])
            replica = _complete(server.url, prompt, max_tokens=1)[1]
            served.setdefault(replica, prompt)
            if len(served) == 2:
                break
        for rank, sub in enumerate(subs):
            prompt = served[f"replica-{rank}"]
            full_blocks = [prompt[i:i + BLOCK] for i in range(0, 3 * BLOCK, BLOCK)]
            stored, deadline = [], time.monotonic() + 30
            while time.monotonic() < deadline and not all(b in stored for b in full_blocks):
                try:
                    topic, seq, payload = sub.recv_multipart()
                except zmq.Again:
                    continue
                ts, events, dp_rank = msgspec.msgpack.decode(payload)  # vLLM's positional batch
                assert dp_rank == rank
                for event in events:
                    if event[0] == "BlockStored":  # [tag, hashes, parent, token_ids, size, ...]
                        tokens, size = event[3], event[4]
                        stored += [tokens[i:i + size] for i in range(0, len(tokens), size)]
            assert all(b in stored for b in full_blocks), (rank, stored[:3])
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()
