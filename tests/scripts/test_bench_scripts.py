"""scripts/bench_host_overhead.py and scripts/bench_startup.py in their --quick modes, and
scripts/bench_moe_cpu.py on its small shapes.

Timings on a shared machine are not assertable: these check the reports' structure, counts
and the arithmetic between their fields, so the benchmark runs for issue 14's figures are not
wasted on a broken script.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: int):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / name), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.subprocess
@pytest.mark.timeout(1000)  # the subprocess's own limit is 900 s
def test_host_overhead_quick(tmp_path):
    out = tmp_path / "host"
    # A long time budget, so the window is the 6 steps asked for even on a loaded machine;
    # 3 prompts of 40 tokens take more than one step's 64 tokens: timing starts after them.
    proc = run_script("bench_host_overhead.py", "--quick", "--batch-sizes", "1", "3",
                      "--prompt-len", "40", "--steps", "6", "--time-budget", "600",
                      "--out", str(out), timeout=900)
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["model_size"] == "tiny" and report["jax"]
    assert len(report["loadavg_start"]) == len(report["loadavg_end"]) == 3
    rows = report["rows"]
    assert [r["num_seqs"] for r in rows] == [1, 3]
    for r in rows:
        assert r["steps"] == 6 and r["untimed_steps"] >= 1
        # Steady decode: at least one device call per step, and nothing compiled meanwhile.
        assert r["calls"] >= r["steps"] and r["calls_per_step"] == r["calls"] / r["steps"]
        assert r["compiles_in_window"] == 0
        assert all(positive(r[k]) for k in ("engine_ms", "engine_p50_ms", "bare_ms"))
        assert math.isclose(r["unhidden_host_ms"], r["engine_ms"] - r["bare_ms"], abs_tol=1e-9)
        assert math.isclose(r["ratio"], r["engine_ms"] / r["bare_ms"], rel_tol=1e-9)
        # One thread's CPU time cannot exceed the wall time it ran in (small slack: clocks).
        assert 0 < r["host_cpu_ms"] <= 1.05 * r["engine_ms"] + 0.01
        # Dispatch CPU time is part of the replay it was timed in (one thread's CPU time within
        # that wall time); the tiny model's 2 layers hold more parameter buffers than its cache.
        assert 0 < r["dispatch_cpu_ms"] * r["calls"] <= 1.05 * r["bare_ms"] * r["steps"]
        buffers = r["step_buffers"]
        assert buffers["params"] > buffers["cache"] >= 1 and buffers["state"] >= 1
        times = {k: v for k, v in r["split"].items() if k.endswith("_ms")}
        assert times and all(v >= 0 for v in times.values())
        assert r["split"]["num_decode_seqs"] == r["num_seqs"]  # every sequence decodes
        assert r["split"].get("num_prefill_seqs", 0) == 0
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# Host overhead per engine step (tiny random model)")
    assert "| dispatch CPU ms/call | buffers/step call |" in md
    for n in (1, 3):
        assert f"\n| {n} | " in md
    assert "load average at end" in proc.stdout and "engine/bare" in proc.stdout


@pytest.mark.subprocess
@pytest.mark.model  # the children load the real SmolLM2
@pytest.mark.timeout(2000)  # two starts, each bounded at 900 s
def test_startup_quick(tmp_path):
    out = tmp_path / "startup"
    proc = run_script("bench_startup.py", "--quick", "--timeout", "900", "--out", str(out),
                      timeout=1900)
    report = json.loads(out.with_suffix(".json").read_text())
    runs = report["runs"]
    assert list(runs) == ["cold", "warm"]
    phases = ("imports_s", "model_load_s", "engine_init_s", "warmup_s", "first_token_s")
    for r in runs.values():
        assert all(positive(r[k]) for k in phases + ("to_serving_s", "process_wall_s"))
        # The phases split the time to the first token, which ends after the engine is ready.
        assert math.isclose(sum(r[k] for k in phases), r["to_first_token_s"], rel_tol=1e-6)
        assert r["to_serving_s"] < r["to_first_token_s"] <= r["process_wall_s"]
        assert r["compiles_after_warmup"] == 0 and r["num_compiled"] >= 1
        assert r["config"]["max_num_seqs"] == 2 and r["max_model_len"] == 64
        # Each start used the temporary cache, not the user's.
        assert "bench_startup_" in r["cache_dir"] and r["cache_dir"].endswith("xla_cache")
    assert runs["warm"]["num_compiled"] == runs["cold"]["num_compiled"]
    assert 0 < runs["cold"]["cache_files"] <= runs["warm"]["cache_files"]
    assert report["warm_meets_target"] == (runs["warm"]["to_serving_s"] <= 10.0)
    md = out.with_suffix(".md").read_text()
    assert "| cold |" in md and "| warm |" in md and "target <= 10 s" in md
    assert "load average at start" in proc.stdout


@pytest.mark.subprocess
@pytest.mark.timeout(700)
def test_bench_moe_cpu_small():
    # The script checks every way against ragged_dot before it times them.
    proc = run_script("bench_moe_cpu.py", "--shapes", "small", "--repeats", "1", "--tm", "8",
                      timeout=600)
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert [int(r[2]) for r in rows] == [2, 16, 512]  # M = tokens x top-2
    assert all(positive(float(r[7])) for r in rows)  # ragged's ms
