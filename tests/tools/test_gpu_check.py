"""scripts/gpu_check.py on CPU: its --dry-run runs every section (interpret-mode kernels, tiny
models) and the kernels agree with their references within the kernel tests' tolerances, so the
one GPU run we get is not wasted on a broken script."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.attention_backends import XlaAttention
from jaxserve.runtime.kv_cache import KVCache
from jaxserve.tools.gpu_check import context, engine_bench, kernel_timings, profiles
from jaxserve.tools.gpu_check.driver import parse_args
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.cases import attention_tolerance, paged_case, ragged_case

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
# SmolLM2 (the served model) before the costlier 8B model.
SECTIONS = ["environment", "bandwidth", "kernel_correctness", "kernel_timings",
            "e2e_smollm2", "llm_defaults", "e2e_llama3_8b", "step_dump", "hf_peer",
            "kernel_tests"]
# May be skipped (with a reason) where the packages are missing, as in .venv on CPU; the
# compiled kernel tests always are in a dry run.
MAY_SKIP = {"hf_peer", "kernel_tests"}


def run_script(out_dir: pathlib.Path, *args: str, timeout: int = 540):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(out_dir), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run_script(out, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.subprocess
def test_every_section_ok_or_skipped_with_reason(dry_run):
    proc, report, out = dry_run
    assert report["dry_run"] is True
    assert list(report["sections"]) == SECTIONS
    for name, sec in report["sections"].items():
        if name in MAY_SKIP and sec["status"] == "skipped":
            assert sec["reason"], name
        else:
            assert sec["status"] == "ok", (name, sec.get("error"), sec.get("traceback"))
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# gpu_check") and md in proc.stdout
    for name in SECTIONS:
        assert f"## {name}: " in md


@pytest.mark.subprocess
def test_kernels_within_tolerance(dry_run):
    _, report, _ = dry_run
    res = report["sections"]["kernel_correctness"]["result"]
    profile = report["profile"]
    assert len(res["paged_attention"]) == len(profile["attn_cases"])
    assert len(res["int4_matmul"]) == len(profile["int4_cases"])
    assert res["num_bad"] == 0
    for row in res["paged_attention"]:
        tol = row["tolerance"]
        assert row["finite"] and row["within_tol"], row
        assert 0 <= row["max_abs_err"] <= tol["atol"] + tol["rtol"] * row["max_abs_ref"]
    for row in res["int4_matmul"]:
        assert row["finite"] and row["within_tol"], row
        assert 0 <= row["max_rel_err"] <= row["tolerance"]["rel"] + row["tolerance"]["scale"]
    assert len(res["lora_sgmv"]) == len(profile["lora_cases"]) >= 1
    for row in res["lora_sgmv"]:  # the kernel and the runtime wrapper, within the tests' bound
        assert row["finite"] and row["within_tol"] and row["max_abs_err"] >= 0, row


@pytest.mark.subprocess
def test_ragged_step_within_tolerance_and_timed(dry_run):
    _, report, _ = dry_run
    cases = report["profile"]["ragged_cases"]
    rows = report["sections"]["kernel_correctness"]["result"]["ragged_attention"]
    assert len(rows) == len(cases) >= 1
    for row in rows:
        tol = row["tolerance"]
        assert row["finite"] and row["within_tol"], row
        assert 0 <= row["max_abs_err"] <= tol["atol"] + tol["rtol"] * row["max_abs_ref"]
    timed = report["sections"]["kernel_timings"]["result"]["ragged_attention"]
    assert len(timed) == len(cases)
    for row in timed:
        for impl in ("kernel", "reference_f32"):
            assert row[impl]["median_s"] > 0 and row[impl]["bytes_per_s"] > 0, row


@pytest.mark.subprocess
def test_timings_and_engine_runs_are_complete(dry_run):
    _, report, _ = dry_run
    timings = report["sections"]["kernel_timings"]["result"]
    for row in timings["paged_attention"] + timings["int4_matmul"]:
        for impl in ("kernel", "xla_engine_path"):
            assert row[impl]["median_s"] > 0 and row[impl]["bytes_per_s"] > 0, row
        assert math.isfinite(row["kernel_over_xla_engine_path"])
    assert len(timings["lora_sgmv"]) == len(report["profile"]["lora_cases"])
    for row in timings["lora_sgmv"]:
        for impl in ("kernel", "xla_tiled", "wrapper", "per_token_xla"):
            assert row[impl]["median_s"] > 0 and row[impl]["flops_per_s"] > 0, row
        assert math.isfinite(row["kernel_over_xla_tiled"])
    assert report["sections"]["bandwidth"]["result"]["copy_bw_Bps"] > 0
    for name in ("e2e_llama3_8b", "e2e_smollm2"):
        res = report["sections"][name]["result"]
        assert [v["quantization"] for v in res["variants"]] == ["none (bf16)", "int4"]
        for variant in res["variants"]:
            assert variant["weight_bytes_per_step"] > 0
            for run in variant["runs"]:
                assert run["all_lengths_ok"] and run["decode_tok_s"] > 0, run
                assert run["compiles_during_run"] == 0, run
                assert run["mbu_weights_vs_nominal"] > 0


@pytest.mark.subprocess
def test_time_budget_skips_sections_with_a_reason(tmp_path):
    proc = run_script(tmp_path, "--dry-run", "--time-budget", "0",
                      "--sections", "environment,bandwidth,e2e_smollm2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["environment"]["status"] == "ok"  # always runs: it costs nothing
    for name in ("bandwidth", "e2e_smollm2"):
        assert sections[name]["status"] == "skipped"
        assert "time budget" in sections[name]["reason"]


@pytest.mark.subprocess
def test_refuses_to_run_the_gpu_profile_without_a_gpu(tmp_path):
    proc = run_script(tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr


def engine_attention(q, k, v, meta, flat):
    """What the XlaAttention backend computes for the case's tokens on this layout, with a KV
    write of the values already in the cache (so the write changes nothing)."""
    q_flat = jnp.zeros((meta.positions.shape[1],) + q.shape[1:], q.dtype).at[flat].set(q)
    block_size = k.shape[2]
    blk, off = meta.slots[0] // block_size, meta.slots[0] % block_size
    cache = KVCache(k=k, v=v)
    out, _ = XlaAttention().attend(q_flat[None], k[1, blk, off][None], v[1, blk, off][None],
                                   cache, jnp.int32(1), meta)
    return out[0, flat]


def test_xla_baseline_is_the_engines_ragged_attention_over_the_same_pages():
    """The timed XLA path reads the kernel's inputs through the engine's step layout (its
    (query, block) pair list); on caches without NaN (the engine's never hold any) it equals
    the reference and the XLA backend's own attention."""
    q, k, v, table, lens = paged_case(3, dtype=jnp.float32, block_size=8, num_kv_heads=3,
                                      group=3, head_dim=64, lens=[1, 8, 9, 30, 0], num_pages=4)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    meta, flat, in_use = kernel_timings.xla_step_inputs(table, lens, 8)
    assert in_use == 1 + 1 + 2 + 4 and meta.pairs.shape[1] >= in_use
    out = kernel_timings.xla_engine_attention()(q, k, v, jnp.int32(1), meta, flat)
    ref = paged_attention_reference(q, k, v, 1, table, lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **attention_tolerance("float32"))
    np.testing.assert_allclose(np.asarray(out), np.asarray(engine_attention(q, k, v, meta, flat)),
                               rtol=1e-6, atol=1e-6)


def test_xla_baseline_takes_the_ragged_kernels_rows():
    """Decodes, multi-query rows (aligned by the layout), a padding row and unowned tokens of
    the ragged kernel's case: the baseline equals its reference and the XLA backend."""
    rows = [(1, 5), (4, 20), (1, 1), (19, 40), (0, 0), (3, 3)]
    q, k, v, table, qs, lens = ragged_case(5, dtype=jnp.float32, block_size=8, num_kv_heads=3,
                                           group=3, head_dim=64, rows=rows, num_pages=5, tail=3)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    meta, flat, _ = kernel_timings.xla_step_inputs(table, lens, 8, qs, q.shape[0])
    assert bool(meta.multi.any())  # the chunked path runs
    out = kernel_timings.xla_engine_attention()(q, k, v, jnp.int32(1), meta, flat)
    ref = ragged_paged_attention_reference(q, k, v, 1, table, qs, lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **attention_tolerance("float32"))
    np.testing.assert_allclose(np.asarray(out), np.asarray(engine_attention(q, k, v, meta, flat)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.subprocess
def test_f32_and_large_cache_cases_within_tolerance(dry_run):
    _, report, _ = dry_run
    rows = report["sections"]["kernel_correctness"]["result"]["ragged_extra"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for row in rows:
        tol = row["tolerance"]
        assert row["finite"] and row["within_tol"], row
        assert 0 <= row["max_abs_err"] <= tol["atol"] + tol["rtol"] * row["max_abs_ref"]
    assert rows[0]["tolerance"] == attention_tolerance("float32")
    # The large-cache case's spare blocks grow its cache to the profile's size.
    gib = report["profile"]["ragged_extra_cases"][1][-1]
    assert rows[1]["cache_bytes"] >= gib * 2**30


@pytest.mark.subprocess
def test_engine_runs_carry_the_step_breakdown(dry_run):
    _, report, _ = dry_run
    for name in ("e2e_smollm2", "e2e_llama3_8b"):
        for variant in report["sections"][name]["result"]["variants"]:
            for run in variant["runs"]:
                b = run["step_breakdown"]
                assert b["steps"] == run["decode_steps"] > 0, b
                assert 0 < b["median_host_s"] <= b["median_total_s"], b
                assert 0 <= b["median_wait_s"] <= b["median_device_s"], b


@pytest.mark.subprocess
def test_plain_llm_defaults_run_and_step_dump_saved(dry_run):
    _, report, out = dry_run
    res = report["sections"]["llm_defaults"]["result"]
    assert res["all_lengths_ok"] and res["generated"] > 0, res
    assert res["config"]["attention_backend"] == "auto"  # nothing but warm-up overridden
    assert res["overrides"] == {"warmup": False}
    dump = report["sections"]["step_dump"]["result"]
    assert dump["modules"] and all("_step_impl" in m for m in dump["modules"]), dump
    files = list((out / "xla_dump_step").iterdir())
    assert files and all(f.name.endswith((".txt", ".ptx")) for f in files)
    assert any(f.name.endswith("after_optimizations.txt") for f in files)


def test_budget_is_checked_between_cases_and_variants():
    args = parse_args(["--dry-run", "--time-budget", "0"])
    ctx = context.Ctx(args, profiles.DRY_PROFILE)
    calls = []
    rows, skipped = context.run_cases(ctx, [(1,), (2,)], lambda c, k: calls.append(k), "x")
    assert rows == [] and skipped == [[1], [2]] and calls == []
    res = engine_bench.bench_model(ctx, "m", type("M", (), {"config": _Config()})(), "src")
    assert [v["skipped"] for v in res["variants"]] == ["time budget exceeded"] * 2


class _Config:
    def to_dict(self):
        return {}

    def num_params(self):
        return 0
