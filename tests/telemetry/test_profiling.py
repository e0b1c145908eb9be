"""Profiling and per-step statistics on a tiny random model (CPU).

A capture of N engine steps must write trace files that contain N `engine_step` events with
their schedule / launch / wait / postprocess parts, and the compiled step's ops must carry the
stage scopes (step, attention, mlp, sampling) in the trace's HLO metadata. Step stats must add
up to what the requests produced.
"""

import gzip
import json
import re

import numpy as np
import pytest
from jax.profiler import ProfileData

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.telemetry.profiling import Profiler, ProfilerError, scope_device_seconds
from jaxserve.testing.tiny_models import TINY_GQA
from models.random_init import random_model

TINY = TINY_GQA
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=3)


def make_engine(model, tmp_path=None, blocks=64):
    per_token = TINY.kv_bytes_per_token(4)
    return LLMEngine(EngineConfig(
        model="tiny", block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=64, kv_cache_memory=blocks * BLOCK * per_token, warmup=False,
        profile_dir=None if tmp_path is None else str(tmp_path)), model=model)


def workload(seed=0, n=6):
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 256, size=int(rng.integers(3, 30))).tolist(),
             int(rng.integers(2, 20))) for _ in range(n)]


def run(engine, reqs):
    """Adds every request, steps to the end; returns generated counts and each step's stats
    (recorded when the step's ids are applied: with asynchronous scheduling one call late)."""
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True))
    generated, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated[out.request_id] = len(out.outputs[0].token_ids)
        if engine.last_step is not None and (not steps or engine.last_step is not steps[-1]):
            steps.append(engine.last_step)
    return generated, steps


def test_step_stats_add_up(model):
    engine = make_engine(model)
    reqs = workload()
    generated, steps = run(engine, reqs)
    assert generated == {f"r{i}": m for i, (_, m) in enumerate(reqs)}
    assert [s.step for s in steps] == list(range(len(steps)))
    assert sum(s.num_sampled for s in steps) == sum(generated.values())
    # Without preemption every prompt token runs once, and every generated token but each
    # request's last is fed back once. (A chunked prompt's final token may run as a decode.)
    assert sum(s.num_tokens for s in steps) == sum(len(p) + m - 1 for p, m in reqs)
    assert sum(s.num_prefill_tokens for s in steps) <= sum(len(p) for p, _ in reqs)
    for s in steps:
        assert s.num_seqs == s.num_prefill_seqs + s.num_decode_seqs <= 4
        assert s.num_decode_tokens == s.num_decode_seqs
        assert s.num_tokens <= 32  # max_num_batched_tokens
        assert min(s.schedule_s, s.device_s, s.postprocess_s, s.wait_s) >= 0
        assert s.wait_s <= s.device_s
        assert s.h2d_bytes > 0
    totals = engine.stats()["step_totals"]
    assert totals["num_steps"] == len(steps)
    assert totals["num_sampled"] == sum(generated.values())
    assert totals["device_s"] == pytest.approx(sum(s.device_s for s in steps))
    hist = totals["histograms"]
    assert hist["batch_size"]["buckets"][-1] == ("+Inf", len(steps))
    assert hist["batch_tokens"]["sum"] == sum(s.num_tokens for s in steps)


def test_step_stats_count_preemptions(model):
    engine = make_engine(model, blocks=17)  # 16 usable blocks = 64 slots: four requests collide
    reqs = [(list(range(1, 20)), 40) for _ in range(4)]
    generated, steps = run(engine, reqs)
    assert sum(generated.values()) == 160 == sum(s.num_sampled for s in steps)
    preempted = sum(s.num_preempted for s in steps)
    assert preempted == engine.stats()["num_preemptions"] > 0
    # Recompute re-runs prompts (and outputs so far) as prefill: more than the prompts alone.
    assert sum(s.num_prefill_tokens for s in steps) > 4 * 19


def op_paths(run_dir) -> set[str]:
    """Op-name paths of the step function, from the HLO metadata inside the .xplane.pb."""
    data = b"".join(p.read_bytes() for p in run_dir.glob("*.xplane.pb"))
    return {m.group(0).decode() for m in re.finditer(rb"jit\(_step_impl\)/[\x21-\x7e]+", data)}


def test_profile_of_n_steps_has_stage_scopes(model, tmp_path):
    engine = make_engine(model, tmp_path)
    run(engine, workload(seed=1, n=3))  # compiles first: XLA compiling under a capture is slow
    engine.start_profile(num_steps=3)
    assert engine.stats()["profiling"]
    run(engine, workload(seed=1, n=3))  # more than 3 steps: the capture stops itself
    assert not engine.profiler.active
    [run_dir] = engine.profiler.captures
    assert run_dir.parent == tmp_path / "plugins" / "profile"
    names = {p.name for p in run_dir.iterdir()}
    assert "perfetto_trace.json.gz" in names and any(n.endswith(".xplane.pb") for n in names)

    # The host timeline: exactly the 3 captured steps, each split into its parts. Each launches
    # a step; the first call of a run has no earlier step to wait for and apply.
    events = [e.name for plane in ProfileData.from_file(
        str(next(run_dir.glob("*.xplane.pb")))).planes for line in plane.lines
        for e in line.events]
    assert events.count("engine_step") == 3
    for part, count in (("schedule", 3), ("launch", 3), ("wait", 2), ("postprocess", 2)):
        assert events.count(part) == count, part
    perfetto = json.loads(gzip.decompress((run_dir / "perfetto_trace.json.gz").read_bytes()))
    assert sum(e.get("name") == "engine_step" for e in perfetto["traceEvents"]) == 3

    # The compiled step's ops by stage: one ragged step holds prefills and decodes alike.
    paths = op_paths(run_dir)
    mine = [p for p in paths if p.startswith("jit(_step_impl)/step/")]
    assert any("/attn/attention/" in p for p in mine)
    assert any("/mlp/" in p for p in mine)
    assert any(p.startswith("jit(_step_impl)/step/sampling/") for p in mine)


def test_profiler_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ProfilerError, match="no profile directory"):
        Profiler().start()
    with pytest.raises(ProfilerError, match="no capture is running"):
        Profiler(tmp_path).stop()
    with pytest.raises(ValueError, match="num_steps"):
        Profiler(tmp_path).start(num_steps=0)
    profiler = Profiler(tmp_path)
    profiler.start()
    try:
        with pytest.raises(ProfilerError, match="already running"):
            profiler.start()
        with pytest.raises(ProfilerError, match="could not start"):
            Profiler(tmp_path).start()  # jax allows one capture per process
    finally:
        run_dir = profiler.stop()
    assert any(run_dir.glob("*.xplane.pb"))


GPU_XSPACE = """
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000
      stats { metadata_id: 1 str_value: "jit(_step_impl)/decode/Llama/layers/attn/attention/dot" } }
    events { metadata_id: 2 offset_ps: 3000000 duration_ps: 5000000
      stats { metadata_id: 1 str_value: "jit(_step_impl)/decode/Llama/layers/mlp/up_proj/dot" } }
    events { metadata_id: 1 offset_ps: 9000000 duration_ps: 1000000
      stats { metadata_id: 1 str_value: "jit(_step_impl)/prefill/Llama/attn/attention/exp" } }
  }
  event_metadata { key: 1 value { id: 1 name: "fusion.1" } }
  event_metadata { key: 2 value { id: 2 name: "fusion.2" } }
  stat_metadata { key: 1 value { id: 1 name: "tf_op" } }
}
planes { id: 2 name: "/host:CPU" }
"""


def test_scope_device_seconds_sums_device_events(tmp_path):
    """The GPU path of the ablation's attention time, on a hand-written GPU-shaped trace
    (no GPU here: the real trace layout is an assumption this test pins down)."""
    (tmp_path / "gpu.xplane.pb").write_bytes(
        ProfileData.text_proto_to_serialized_xspace(GPU_XSPACE))
    assert scope_device_seconds(tmp_path, "attention") == pytest.approx(3e-6)
    assert scope_device_seconds(tmp_path, "mlp") == pytest.approx(5e-6)
    assert scope_device_seconds(tmp_path, "sampling") == 0
    host_only = tmp_path / "cpu"
    host_only.mkdir()
    (host_only / "cpu.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(
        'planes { id: 2 name: "/host:CPU" }'))
    assert scope_device_seconds(host_only, "attention") is None
