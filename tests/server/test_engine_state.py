"""GET /v1/engine/state: its schema and its agreement with the engine, on real requests.

A tiny random model (several KV blocks per request, prefix caching on) serves requests over
HTTP while the test polls the endpoint. What the snapshot says is checked against what the
block manager and the engine's stats say independently (block counts, refcounts, slots), and
against what the test itself sent (prompt lengths, a repeated prompt's cache hits).
"""

import time

import jsonschema
import pytest
import requests

from jaxserve.server.engine_state import StateSampler
import engine_state_fixtures as fx

INT = {"type": "integer", "minimum": 0}
NUM = {"type": "number", "minimum": 0}
INT_LIST = {"type": "array", "items": {"type": "integer"}}
SLOT = {"type": "object", "required": ["slot", "request_id", "phase", "prompt_tokens",
                                       "output_tokens", "computed_tokens", "blocks"],
        "properties": {"slot": {"type": ["integer", "null"]}, "request_id": {"type": "string"},
                       "phase": {"enum": ["prefill", "decode"]}, "prompt_tokens": INT,
                       "output_tokens": INT, "computed_tokens": INT, "blocks": INT}}
WAITING = {"type": "object", "required": ["request_id", "prompt_tokens", "preempted"],
           "properties": {"request_id": {"type": "string"}, "prompt_tokens": INT,
                          "output_tokens": INT, "preempted": {"type": "boolean"}}}
SCHEMA = {
    "type": "object",
    "required": ["version", "time", "monotonic", "age_s", "loop_iteration", "config", "slots",
                 "waiting", "blocks", "gauges", "counters", "server", "model"],
    "properties": {
        "version": {"const": 1}, "time": NUM, "age_s": NUM, "loop_iteration": INT,
        "model": {"type": "string"},
        "config": {"type": "object", "required": ["max_num_seqs", "block_size", "max_model_len",
                                                  "prefix_caching"]},
        "slots": {"type": "array", "items": SLOT},
        "waiting": {"type": "array", "items": WAITING},
        "blocks": {"type": "object",
                   "required": ["num_blocks", "block_size", "first_usable", "ref_counts",
                                "cached", "owner", "owners"],
                   "properties": {"num_blocks": INT, "block_size": INT, "first_usable": INT,
                                  "ref_counts": INT_LIST, "cached": INT_LIST, "owner": INT_LIST,
                                  "owners": {"type": "array", "items": {"type": "string"}}}},
        "gauges": {"type": "object", "additionalProperties": INT,
                   "required": ["kv_blocks_total", "kv_blocks_free", "kv_blocks_in_use",
                                "prefix_cache_blocks", "running", "waiting"]},
        "counters": {"type": "object", "additionalProperties": INT,
                     "required": ["tokens_computed", "num_preemptions", "cow_copies",
                                  "prefix_cache_hits_tokens", "prefix_cache_queries_tokens",
                                  "num_steps", "decode_tokens", "prefill_tokens"]},
        "server": {"type": "object", "required": ["ttft_sum_s", "ttft_count",
                                                  "generation_tokens", "in_flight"]},
    },
}


@pytest.fixture(scope="module")
def engine():
    return fx.tiny_engine()


@pytest.fixture(scope="module")
def loop(engine):
    loop = fx.start_loop(engine, state_interval_s=0.05)
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def server(loop):
    with fx.serve(loop) as s:
        yield s


def check_consistent(snap: dict) -> None:
    """What the snapshot must satisfy by itself, whatever the engine was doing."""
    jsonschema.validate(snap, SCHEMA)
    b, g = snap["blocks"], snap["gauges"]
    n = b["num_blocks"]
    assert len(b["ref_counts"]) == len(b["cached"]) == len(b["owner"]) == n
    usable = range(b["first_usable"], n)
    assert g["kv_blocks_total"] == len(usable)
    assert sum(1 for i in usable if b["ref_counts"][i] > 0) == g["kv_blocks_in_use"]
    assert sum(b["cached"]) == g["prefix_cache_blocks"]
    for i in range(n):  # a block has an owner exactly when someone references it
        assert (b["owner"][i] >= 0) == (b["ref_counts"][i] > 0), i
    owned = {}
    for i, o in enumerate(b["owner"]):
        if o >= 0:
            owned[b["owners"][o]] = owned.get(b["owners"][o], 0) + 1
    for s in snap["slots"]:  # a request holds at least the blocks it names first
        assert owned.get(s["request_id"], 0) <= s["blocks"]
    assert len(snap["slots"]) == g["running"] and len(snap["waiting"]) == g["waiting"]


def test_requires_the_api_key(server):
    r = requests.get(server.url + "/v1/engine/state", timeout=30)
    assert r.status_code == 401
    assert fx.get_state(server.url)["model"] == fx.MODEL


def test_idle_snapshot_matches_the_block_manager(server, loop, engine):
    fx.wait_idle(loop)
    snap = fx.fresh_state(server.url)
    check_consistent(snap)
    bm = engine.scheduler.block_manager
    assert snap["blocks"]["num_blocks"] == bm.num_blocks
    assert snap["gauges"]["kv_blocks_free"] == bm.num_free_blocks == bm.num_usable_blocks
    assert snap["config"]["block_size"] == fx.BLOCK_SIZE and snap["slots"] == []


def test_running_requests_show_slots_and_blocks_then_free_them(server, loop, engine):
    fx.wait_idle(loop)
    tok = engine.model.tokenizer
    prompts = [f"request number {i} says hello" for i in range(3)]
    lens = {len(tok.encode(p)) + (1 if tok.add_bos else 0) for p in prompts}
    # Two snapshots while the requests run, each taken with the engine held (after two of them
    # decode together, then once more a step later), so a slow poll on a loaded machine cannot
    # miss them or see the requests finished between the two.
    seen = []
    threads = []
    for _ in range(2):
        with fx.held_once(engine, lambda e: fx.decoding(e) >= 2) as wait_held:
            threads = threads or fx.in_background(server.url, prompts, max_tokens=100)
            wait_held()
            snap = fx.fresh_state(server.url)
        check_consistent(snap)
        seen.append(snap)
    for t in threads:
        t.join(120)
    busiest = max(seen, key=lambda s: len(s["slots"]))
    assert len(busiest["slots"]) >= 2
    assert {s["prompt_tokens"] for s in busiest["slots"]} <= lens
    assert all(s["slot"] is not None for s in busiest["slots"] if s["output_tokens"])
    slots = [s["slot"] for s in busiest["slots"] if s["slot"] is not None]
    assert len(slots) == len(set(slots)) and all(0 <= x < fx.MAX_NUM_SEQS for x in slots)
    # Outputs grow between snapshots of one request: the map follows decode.
    values: dict[str, set] = {}
    for snap in seen:
        for s in snap["slots"]:
            values.setdefault(s["request_id"], set()).add(s["output_tokens"])
    assert max(len(v) for v in values.values()) >= 2, [s["slots"] for s in seen]
    assert max(s["blocks"] for s in busiest["slots"]) >= 2  # 100 tokens span several blocks
    fx.wait_idle(loop)
    idle = fx.fresh_state(server.url)
    check_consistent(idle)
    assert idle["slots"] == [] and not any(idle["blocks"]["ref_counts"])
    assert idle["counters"]["decode_tokens"] >= busiest["counters"]["decode_tokens"] + 1


def test_a_repeated_prompt_shows_cached_blocks_and_hits(server, loop, engine):
    fx.wait_idle(loop)
    before = fx.fresh_state(server.url)
    fx.complete(server.url, fx.SHARED_PREFIX, max_tokens=4)
    after_first = fx.wait_idle(loop)
    cached_free = [i for i, c in enumerate(after_first["blocks"]["cached"])
                   if c and after_first["blocks"]["ref_counts"][i] == 0]
    tok = engine.model.tokenizer
    prompt_len = len(tok.encode(fx.SHARED_PREFIX)) + (1 if tok.add_bos else 0)
    assert prompt_len > 2 * fx.BLOCK_SIZE  # the prompt spans several full blocks
    # Every full block of the prompt is registered once computed (and the last one decoded).
    assert len(cached_free) >= prompt_len // fx.BLOCK_SIZE
    fx.complete(server.url, fx.SHARED_PREFIX, max_tokens=4)
    after = fx.fresh_state(server.url)
    hits = after["counters"]["prefix_cache_hits_tokens"] - \
        before["counters"]["prefix_cache_hits_tokens"]
    assert hits == ((prompt_len - 1) // fx.BLOCK_SIZE) * fx.BLOCK_SIZE
    assert after["server"]["ttft_count"] >= before["server"]["ttft_count"] + 2


def test_sampler_rebuilds_only_after_its_interval(engine):
    sampler = StateSampler(interval_s=60.0)
    stats = engine.stats()
    assert sampler.maybe_refresh(engine, stats, 1) and sampler.latest()["loop_iteration"] == 1
    assert not sampler.maybe_refresh(engine, stats, 2)
    assert sampler.latest()["loop_iteration"] == 1 and sampler.num_built == 1
    with pytest.raises(ValueError, match="interval"):
        StateSampler(interval_s=0)


def test_block_map_refcounts_agree_with_the_block_manager_when_shared():
    """Refcounts the snapshot counts from block tables equal the block manager's own, with a
    fork sharing blocks and a finished sequence's blocks left cached."""
    import types
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.scheduler import Scheduler, SchedulerConfig
    from jaxserve.core.sequence import Sequence
    from jaxserve.server.engine_state import snapshot
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                      max_model_len=64, block_size=4, num_blocks=32,
                                      enable_prefix_caching=True))
    bm = sched.block_manager
    seqs = [Sequence(f"s{i}", list(range(10 * i, 10 * i + 10)), SamplingParams(max_tokens=4))
            for i in range(3)]
    for seq in seqs:
        bm.allocate(seq, cached=[])
        seq.num_computed_tokens = seq.num_tokens
        bm.register_computed(seq)
    child = Sequence("s0-child", seqs[0].prompt_token_ids, SamplingParams(max_tokens=4))
    bm.fork(seqs[0], child)
    bm.free(seqs[2])  # its full blocks stay cached, referenced by nobody
    sched.running.extend([seqs[0], child, seqs[1]])
    engine = types.SimpleNamespace(
        scheduler=sched, runner=types.SimpleNamespace(slot_of={"s0": 0, "s0-child": 1, "s1": 2}),
        config=types.SimpleNamespace(max_num_seqs=4, block_size=4), max_model_len=64)
    b = snapshot(engine, {}, 0)["blocks"]
    assert b["ref_counts"] == [bm.ref_count(i) for i in range(bm.num_blocks)]
    assert sum(1 for r in b["ref_counts"] if r == 2) == len(seqs[0].block_table)
    assert b["cached"] == [1 if i in bm.cache.hash_of else 0 for i in range(bm.num_blocks)]
    assert {b["owners"][b["owner"][i]] for i in seqs[0].block_table} == {"s0"}
    assert sum(b["cached"]) == 3 * (10 // 4)  # two full blocks per sequence


def test_page_url_names_a_host_a_browser_can_open():
    from types import SimpleNamespace as NS
    from jaxserve.server.serve import page_url
    assert page_url(NS(effective_host="127.0.0.1", effective_port=8000)) == "http://127.0.0.1:8000/"
    assert page_url(NS(effective_host="0.0.0.0", effective_port=80)) == "http://localhost:80/"
    assert page_url(NS(effective_host="::1", effective_port=9)) == "http://[::1]:9/"


def test_a_failing_snapshot_does_not_stop_the_engine_loop(engine):
    """An engine without what the snapshot reads (a wrapper, a mock) still serves."""
    class Bare:
        def __init__(self, inner):
            self._inner = inner

        def stats(self):
            return self._inner.stats()

        def has_unfinished_requests(self):
            return False

    loop = fx.start_loop(Bare(engine), state_interval_s=0.01)
    try:
        time.sleep(0.2)
        assert loop.alive and loop.engine_state() is None
        assert isinstance(loop.state.error, AttributeError)
    finally:
        loop.stop()
