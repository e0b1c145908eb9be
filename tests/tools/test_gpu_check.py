"""scripts/gpu_check.py on CPU: its --dry-run runs every section (interpret-mode kernels, tiny
models) and the kernels agree with their references within the kernel tests' tolerances, and
what it leaves under --out-dir would all come back from the lent machine (three files within
the return limits), so the one GPU run we get is not wasted on a broken script."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.attention_backends import XlaAttention
from jaxserve.runtime.kv_cache import KVCache
from jaxserve.tools.gpu_check import (bundle, context, driver, engine_bench, gmm_timing,
                                     guards, int4_timing, kernel_timings, profiles, report,
                                     step_dump, trace_reader)
from jaxserve.tools.gpu_check.driver import parse_args
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.cases import attention_tolerance, paged_case, ragged_case

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
# Preflight first, kernel checks before the engine, SmolLM2 (the served model) and its trace
# before the costlier 8B model, the plain-defaults run and the peer after, the readers last.
SECTIONS = ["preflight", "bandwidth", "kernel_correctness", "kernel_tests", "kernel_timings",
            "launch_floor", "e2e_smollm2", "decode_trace", "e2e_llama3_8b", "llm_defaults",
            "hf_peer", "step_dump", "prediction"]
# May be skipped (with a reason) where the packages are missing, as in .venv on CPU; the
# compiled kernel tests always are in a dry run.
MAY_SKIP = {"hf_peer", "kernel_tests"}
# Cheap sections that still reach the trace, the step dump and the bundle: the fast test's run.
# Its decode_trace builds an engine of its own (the full run's reuses e2e_smollm2's). The
# performance model's prediction of the traced step is checked on the full run alone: it is
# the same deviceless compile of the same model either way.
QUICK = "preflight,launch_floor,decode_trace,step_dump"


def run_script(out_dir: pathlib.Path, *args: str, timeout: int = 540):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    scratch = out_dir.parent / f"{out_dir.name}_scratch"  # never inside the out dir
    return subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(out_dir),
                           "--scratch-dir", str(scratch), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def tar_names(out: pathlib.Path) -> list[str]:
    with tarfile.open(out / bundle.TAR_NAME) as tar:
        return tar.getnames()


def assert_bundle_within_limits(out: pathlib.Path, report: dict) -> None:
    files = sorted(f.name for f in out.rglob("*") if f.is_file())
    assert files == sorted([bundle.JSON_NAME, bundle.MD_NAME, bundle.TAR_NAME]), files
    assert bundle.out_dir_problems(out) == [] == report["bundle"]["out_dir_problems"]
    assert (out / bundle.TAR_NAME).stat().st_size <= bundle.LIMITS.tar_bytes
    assert all(bundle.NAME_RE.match(f) for f in files)
    assert "MANIFEST.json" in tar_names(out)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_quick")
    proc = run_script(out, "--dry-run", "--sections", QUICK, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads((out / bundle.JSON_NAME).read_text()), out


@pytest.mark.subprocess
def test_quick_dry_run_bundles_within_the_return_limits(quick_run):
    """Every section has a status (the unselected ones skipped with a reason); three files
    come back; the tar holds the trace, the traced step's optimized HLO and the manifest."""
    proc, report, out = quick_run
    assert list(report["sections"]) == SECTIONS
    for name, sec in report["sections"].items():
        assert sec["status"] in ("ok", "skipped"), (name, sec)
        if name not in QUICK.split(","):
            assert sec["reason"] == "not selected (--sections)"
    assert_bundle_within_limits(out, report)
    names = tar_names(out)
    assert any(n.startswith("trace/") and n.endswith(".xplane.pb") for n in names), names
    traced = step_dump.traced_dump_names(
        report["sections"]["decode_trace"]["result"]["trace"]["modules"])
    assert traced and any(n.startswith(f"step_dump/{traced[0]}.") and
                          n.endswith("after_optimizations.txt") for n in names), (traced, names)
    assert "gpu_check: dumps, trace and this stderr go to" in proc.stderr
    assert "logs/stderr.log" in names


@pytest.mark.subprocess
def test_quick_dry_run_reads_the_trace_into_per_kernel_times(quick_run):
    _, report, _ = quick_run
    res = report["sections"]["decode_trace"]["result"]
    assert res["traced_steps"] == report["profile"]["trace_steps"]
    assert res["compiles_while_traced"] == 0
    t = res["trace"]
    assert t["events"] > 0 and t["per_kernel_s"] and t["top"], t
    assert all(isinstance(v, float) and v > 0 for v in t["per_kernel_s"].values())
    # The per-kernel seconds add up to the kernels' time (overlap aside, at least the busy time).
    assert sum(t["per_kernel_s"].values()) >= t["busy_s_per_step"] * 0.999
    assert 0 < t["busy_s_per_step"] <= t["wall_s_per_step"]
    floor = report["sections"]["launch_floor"]["result"]
    chains = report["profile"]["launch_chain"]
    assert [c["kernels_in_program"] for c in floor["chains"]] == list(chains)
    assert "us_per_kernel" in floor


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
def test_prediction_costs_the_traced_step(dry_run):
    """The performance model costs the traced model's step compiled for an H200 and predicts
    it; a CPU trace shares at most a stray instruction name with it, so nothing is fitted."""
    _, report, _ = dry_run
    pred = report["sections"]["prediction"]["result"]
    assert pred["source"].startswith("deviceless H200 compile"), pred
    assert pred["kernels"] > 0 and pred["matched_kernels"] < 3
    p = pred["predicted"]
    assert p["kernels"] == pred["kernels"] and p["floor_us"] < p["step_us"]
    assert 0 < p["mbu"] < 1 and "skipped" in pred["fit"]


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
        for impl in ("kernel", "reference_f32", "kernel_int8"):
            assert row[impl]["median_s"] > 0 and row[impl]["bytes_per_s"] > 0, row
        # The int8 cache's row counts its bytes: the codes and their f32 scales.
        head_dim = row["cache_shape"][-1]
        int8 = row["kernel_int8"]
        assert int8["bytes_per_s"] * int8["median_s"] == pytest.approx(
            row["bytes_per_call"] * (head_dim + 4) // (2 * head_dim)), row


@pytest.mark.subprocess
def test_timings_and_engine_runs_are_complete(dry_run):
    _, report, _ = dry_run
    timings = report["sections"]["kernel_timings"]["result"]
    for row in timings["paged_attention"]:
        for impl in ("kernel", "xla_engine_path"):
            assert row[impl]["median_s"] > 0 and row[impl]["bytes_per_s"] > 0, row
        assert math.isfinite(row["kernel_over_xla_engine_path"])
    for row in timings["int4_matmul"]:  # the kernel beside both XLA int4 baselines
        for impl in ("kernel", "xla_bf16_dequant", "xla_native_int4", "dense_bf16_xla"):
            assert row[impl]["median_s"] > 0 and row[impl]["bytes_per_s"] > 0, row
        assert row["xla_native_int4"]["bytes_per_call"] < row["bytes_per_call"]  # bf16 scales
        assert math.isfinite(row["kernel_over_xla_bf16_dequant"])
    assert len(timings["grouped_matmul"]) == len(report["profile"]["gmm_cases"]) >= 1
    for row in timings["grouped_matmul"]:
        check_gmm_row(row)
    assert len(timings["lora_sgmv"]) == len(report["profile"]["lora_cases"])
    for row in timings["lora_sgmv"]:
        for impl in ("kernel", "xla_tiled", "wrapper", "per_token_xla"):
            assert row[impl]["median_s"] > 0 and row[impl]["flops_per_s"] > 0, row
        assert math.isfinite(row["kernel_over_xla_tiled"])
    assert report["sections"]["bandwidth"]["result"]["copy_bw_Bps"] > 0
    for name, field in (("e2e_llama3_8b", "e2e_variants_8b"), ("e2e_smollm2", "e2e_variants")):
        res = report["sections"][name]["result"]
        want = [(q or "none (bf16)", b) for q, b in report["profile"][field]]
        assert [(v["quantization"], v["backend"]) for v in res["variants"]] == want
        for variant in res["variants"]:
            assert variant["dump_modules"], variant  # each variant compiled its own step
            assert variant["weight_bytes_per_step"] > 0
            for run in variant["runs"]:
                assert run["all_lengths_ok"] and run["decode_tok_s"] > 0, run
                assert run["compiles_during_run"] == 0, run
                assert run["mbu_weights_vs_nominal"] > 0


@pytest.mark.subprocess
def check_gmm_row(row: dict) -> None:
    """A grouped matmul timing row: both kernels (bf16 and int8 codes) and ragged_dot timed,
    their ratios, and the bytes of the Mosaic GPU kernel's cost() for the case's rows."""
    from pallas_kernels.grouped_matmul_mgpu import cost
    impls = ("kernel", "mosaic_kernel", "xla_ragged_dot", "kernel_int8", "mosaic_kernel_int8")
    for impl in impls:
        assert row[impl]["median_s"] > 0 and row[impl]["flops_per_s"] > 0, row
    for ratio in ("kernel_over_mosaic_kernel", "kernel_over_xla_ragged_dot",
                  "kernel_int8_over_mosaic_kernel_int8"):
        assert math.isfinite(row[ratio]) and row[ratio] > 0, row
    assert row["M"] == row["tokens"] * row["top_k"]
    bf16 = cost(row["M"], row["E"], row["K"], row["N"])
    int8 = cost(row["M"], row["E"], row["K"], row["N"], int8=True)
    assert row["bytes_per_call"] == bf16["bytes"] and row["flops_per_call"] == bf16["flops"]
    assert row["bytes_per_call_int8"] == int8["bytes"] < bf16["bytes"]
    for impl in impls:
        want = int8["bytes"] if impl.endswith("int8") else bf16["bytes"]
        assert row[impl]["bytes_per_call"] == want
        assert row[impl]["bytes_per_s"] * row[impl]["median_s"] == pytest.approx(want)


def test_grouped_matmul_timing_row_in_interpret_mode():
    """The dry run's grouped matmul case, in process: every implementation timed, the routed
    rows grouped by expert (top_k distinct experts per token), the row rendered in the
    timings table."""
    ctx = context.Ctx(parse_args(["--dry-run"]), profiles.DRY_PROFILE)
    case = profiles.DRY_PROFILE.gmm_cases[0]
    row = gmm_timing.time_gmm(ctx, *case)
    check_gmm_row(row)
    c = ctx.cases[("gmm", *case)]
    sizes = np.asarray(c["group_sizes"])
    assert sizes.sum() == row["M"] and (sizes <= row["tokens"]).all()
    assert row["experts_reached"] == int((sizes > 0).sum()) >= row["top_k"]
    md = report.md_timings({"grouped_matmul": [row]})[-1]
    assert md.startswith("| grouped_matmul | olmoe E8 128->128 T4 top2 (M8, ")
    assert "Mosaic GPU" in md and "int8: Triton" in md and md.count("|") == 12


def test_time_budget_skips_sections_with_a_reason(tmp_path):
    proc = run_script(tmp_path, "--dry-run", "--time-budget", "0",
                      "--sections", "preflight,bandwidth,e2e_smollm2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["preflight"]["status"] == "ok"  # always runs: it costs nothing
    for name in ("bandwidth", "e2e_smollm2"):
        assert sections[name]["status"] == "skipped"
        assert "time budget" in sections[name]["reason"]


@pytest.mark.subprocess
def test_refuses_to_run_the_gpu_profile_without_a_gpu(tmp_path):
    """Preflight stops the run, and the record of why still comes back in the bundle."""
    proc = run_script(tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr
    report = json.loads((tmp_path / bundle.JSON_NAME).read_text())
    pre = report["sections"]["preflight"]
    assert pre["status"] == "failed" and "no GPU" in pre["reason"]
    assert pre["result"]["nvidia_smi"]["available"] in (True, False)
    assert all(s["status"] == "skipped" and s["reason"].startswith("preflight")
               for n, s in report["sections"].items() if n != "preflight")
    assert_bundle_within_limits(tmp_path, report)


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
    assert_bundle_within_limits(out, report)
    names = [n for n in tar_names(out) if n.startswith("step_dump/")]
    assert names and all(n.endswith((".txt", ".ptx")) for n in names)
    variant_modules = {m for mods in dump["variant_modules"].values() for m in mods}
    assert {step_dump.module_name(n.split("/")[1]) for n in names
            if n.endswith("after_optimizations.txt")} >= variant_modules


def test_budget_is_checked_between_cases_and_variants():
    args = parse_args(["--dry-run", "--time-budget", "0"])
    ctx = context.Ctx(args, profiles.DRY_PROFILE)
    calls = []
    rows, skipped = context.run_cases(ctx, [(1,), (2,)], lambda c, k: calls.append(k), "x")
    assert rows == [] and calls == []
    assert skipped == [{"case": [k], "what": "x", "reason": "time budget (0s) exceeded"}
                       for k in (1, 2)]
    variants = ((None, "xla"), ("int4", "xla"))
    res = engine_bench.bench_model(ctx, "m", type("M", (), {"config": _Config()})(), "src",
                                   variants)
    assert [v["skipped"] for v in res["variants"]] == ["time budget (0s) exceeded"] * 2
    assert res["_status"] == "partial"
    # A section's cap is a budget too, and the reason says which one ran out.
    ctx = context.Ctx(parse_args(["--dry-run"]), profiles.DRY_PROFILE)
    ctx.enter_section("kernel_timings", 0.0)
    assert ctx.over_budget() and "section cap" in ctx.budget_reason()
    ctx.leave_section()
    assert not ctx.over_budget()


class _Config:
    def to_dict(self):
        return {}

    def num_params(self):
        return 0


def test_out_dir_problems_names_each_broken_limit(tmp_path):
    """The check the driver and the tests rely on fails on each way an out dir breaks the
    machine's return limits (and passes a clean one)."""
    limits = bundle.Limits(max_files=3, file_bytes=100, total_bytes=250)
    (tmp_path / "gpu_check.json").write_bytes(b"x" * 50)
    assert bundle.out_dir_problems(tmp_path, limits) == []
    (tmp_path / "big.tar.gz").write_bytes(b"x" * 101)
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_bytes(b"x")
    (tmp_path / "bad name.txt").write_bytes(b"x" * 99)
    problems = "\n".join(bundle.out_dir_problems(tmp_path, limits))
    assert "4 files (at most 3)" in problems
    assert "big.tar.gz: 101 bytes" in problems
    assert "3 folders deep" in problems
    assert "bad name.txt: names outside" in problems
    assert "251 bytes in all" in problems


def test_tar_stays_under_its_limit_with_incompressible_dumps(tmp_path):
    """Random (incompressible) dumps far over the limit: the tar keeps the trace first (whole:
    a cut protobuf is unreadable; one too big for the room is left out), cuts text over the
    member cap, leaves out what does not fit, and stays under its limit."""
    rng = np.random.default_rng(0)
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    (scratch / "trace" / "plugins").mkdir(parents=True)
    (scratch / "xla_dump").mkdir()
    out.mkdir()
    (scratch / "trace" / "plugins" / "vm.trace.json.gz").write_bytes(rng.bytes(2 << 20))
    (scratch / "trace" / "plugins" / "vm.xplane.pb").write_bytes(rng.bytes(300_000))
    (scratch / "ptxas.log").write_text("ptxas info    : Used 40 registers\n")
    (scratch / "stderr.log").write_bytes(rng.bytes(100_000))
    for i in range(6):
        for suffix in ("cpu_after_optimizations.txt", "thunk_sequence_after_thunk_passes.txt",
                       "ptx"):
            (scratch / "xla_dump" / f"module_000{i}.jit__step_impl.{suffix}").write_bytes(
                rng.bytes(200_000))
    limits = bundle.Limits(tar_bytes=3 << 19, member_bytes=150_000)
    man = bundle.build_bundle(out, scratch, ["module_0003.jit__step_impl"],
                              [f"module_000{i}.jit__step_impl" for i in range(6)], limits)
    size = (out / bundle.TAR_NAME).stat().st_size
    assert size == man["tar_bytes"] <= limits.tar_bytes
    names = tar_names(out)
    assert names[:2] == ["trace/vm.xplane.pb", "logs/ptxas.log"] and names[-1] == "MANIFEST.json"
    assert names[2].startswith("step_dump/module_0003.")  # the traced step before the rest
    assert man["included"][0] == {"name": "trace/vm.xplane.pb", "bytes": 300_000}
    assert man["left_out"][0]["name"] == "trace/vm.trace.json.gz"
    assert "binary" in man["left_out"][0]["why"]
    kept = [m["kept"] for m in man["truncated"]]
    assert kept[0] == 150_000 and max(kept) == 150_000  # the last may be cut to the room left
    assert man["left_out"][-1]["why"] == "tar limit reached"
    with tarfile.open(out / bundle.TAR_NAME) as tar:
        manifest = json.loads(tar.extractfile("MANIFEST.json").read())
        assert b"Used 40 registers" in tar.extractfile("logs/ptxas.log").read()
    assert manifest["left_out"] == man["left_out"]


def test_trace_summary_busy_time_gaps_and_per_kernel_seconds():
    """Two steps of three kernels (two overlapping): busy is the union, gaps the idle time
    between the union's spans, per-kernel seconds the mean per step."""
    def ev(op, start, dur):
        return {"name": f"k_{op}", "op": op, "module": "jit__step_impl", "program_id": 7,
                "start_ns": float(start), "dur_ns": float(dur), "plane": "/device:GPU:0"}
    events = []
    for base in (0, 10_000):
        events += [ev("a", base, 1000), ev("b", base + 500, 1000), ev("c", base + 3000, 2000)]
    s = trace_reader.summarise(events, steps=2)
    assert s["kernels_per_step"] == 3 and s["distinct_kernels"] == 3
    assert s["busy_s"] == pytest.approx(2 * 3500e-9)
    assert s["wall_s"] == pytest.approx(15_000e-9)
    assert s["gaps"]["count"] == 3
    assert s["gaps"]["mean_us"] == pytest.approx((1.5 + 5.0 + 1.5) / 3)
    assert s["per_kernel_s"] == pytest.approx({"a": 1e-6, "b": 1e-6, "c": 2e-6})
    assert s["top"][0]["kernel"] == "c" and s["modules"] == {"jit__step_impl#7": 6}
    assert step_dump.traced_dump_names(s["modules"]) == ["module_0007.jit__step_impl"]


def test_int4_baselines_compute_the_kernels_product():
    """Both XLA baselines are the same quantized product as the kernel's f32 reference (a
    baseline computing something else would not be one), up to their bf16 roundings: the
    dequantized weight s u + o in bf16 (a product and a sum, each rounded: at most 3 units of
    2^-8 on |s u| + |o|), exact bf16 products summed in f32, the result rounded to bf16."""
    from pallas_kernels.cases import int4_weights
    from pallas_kernels.int4_matmul import int4_matmul_reference, unpack_int4
    k, n, g = 256, 128, 64
    packed, scales, offsets = int4_weights(k, n, g, symmetric=False, seed=3)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, k)), jnp.bfloat16)
    ref = np.asarray(int4_matmul_reference(x.astype(jnp.float32), packed, scales, offsets,
                                           group_size=g), np.float64)
    u = np.asarray(unpack_int4(packed, group_size=g), np.float64)  # [K, N]
    s64, o64 = (np.repeat(np.asarray(a, np.float64), g, axis=0) for a in (scales, offsets))
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    bound = (3 * 2.0**-8 * (np.abs(x64) @ (np.abs(s64 * u) + np.abs(o64)))
             + 2.0**-8 * np.abs(ref) + 1e-5)
    deq = int4_timing.bf16_dequant_matmul(g)(x, packed, scales, offsets)
    q, s, o = int4_timing.native_int4_weights(packed, scales, offsets, g)
    assert q.dtype == jnp.int4 and s.dtype == o.dtype == jnp.bfloat16
    nat = int4_timing.native_int4_matmul(g)(x, q, s, o)
    for got in (deq, nat):
        assert np.all(np.abs(np.asarray(got, np.float32) - ref) < bound)


def test_a_section_that_ignores_the_budget_is_stopped_at_its_hard_cap(monkeypatch):
    monkeypatch.setattr(driver, "SECTION_GRACE_S", 0.3)
    prof = dataclasses.replace(profiles.DRY_PROFILE, section_cap_s=(("busy", 0.2),))
    ctx = context.Ctx(parse_args(["--dry-run"]), prof)

    def busy(c):
        while True:  # never checks the budget
            time.sleep(0.01)
    t0 = time.monotonic()
    # The driver's SIGALRM handler, for this test only (pytest-timeout's is put back after).
    old = signal.signal(signal.SIGALRM, guards.raiser(guards.SectionTimeout))
    try:
        sec = driver.run_section(ctx, "busy", busy)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert sec["status"] == "error" and "hard stop" in sec["error"], sec
    assert time.monotonic() - t0 < 5
    assert ctx.deadline == ctx.run_deadline  # the section's cap is gone after it


def test_kernel_checks_registered_in_cases_are_run(monkeypatch):
    """A check in pallas_kernels.cases.GPU_CHECK_CASES runs without gpu_check naming it; one
    out of tolerance fails the section."""
    import pallas_kernels.cases as cases
    from jaxserve.tools.gpu_check import kernel_correctness
    seen = []

    def good(interpret, small):
        seen.append((interpret, small))
        return {"within_tol": True, "max_abs_err": 0.0}
    monkeypatch.setattr(cases, "GPU_CHECK_CASES", {"sampler": good}, raising=False)
    empty = dataclasses.replace(profiles.DRY_PROFILE, attn_cases=(), int4_cases=(),
                                ragged_cases=(), ragged_extra_cases=(), lora_cases=())
    ctx = context.Ctx(parse_args(["--dry-run"]), empty)
    res = kernel_correctness.section_kernel_correctness(ctx)
    assert "_status" not in res and seen == [(True, True)]
    assert res["registered"] == [{"case": "sampler", "within_tol": True, "max_abs_err": 0.0}]
    monkeypatch.setattr(cases, "GPU_CHECK_CASES",
                        {"sampler": lambda **_: {"within_tol": False, "max_abs_err": 1.0}})
    assert kernel_correctness.section_kernel_correctness(ctx)["_status"] == "failed"


def test_watchdog_writes_and_exits_while_the_main_thread_is_stuck():
    """The watchdog runs its writer and ends the process (status 3) though the main thread
    never returns; cancelled first, it lets the main thread write instead."""
    code = ("import time\n"
            "from jaxserve.tools.gpu_check.guards import Watchdog\n"
            "Watchdog(0.2, lambda: print('wrote the bundle', flush=True)).start()\n"
            "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=20, cwd=REPO)
    assert proc.returncode == 3 and "wrote the bundle" in proc.stdout, proc
    fired = []
    dog = guards.Watchdog(0.05, lambda: fired.append(1))
    dog.start()
    assert dog.cancel() and not dog.finishing.acquire(blocking=False)
    time.sleep(0.1)
    assert fired == []


@pytest.mark.subprocess
def test_sigterm_mid_section_still_returns_the_bundle(tmp_path):
    """A `timeout` around the run (SIGTERM) while a section runs: the running section is
    recorded as interrupted, the rest as not reached, and the three files come back."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out-dir", str(out),
                             "--scratch-dir", str(tmp_path / "scratch"),
                             "--sections", "preflight,e2e_smollm2,decode_trace"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=REPO, env=env)
    try:
        for line in proc.stdout:
            if "section e2e_smollm2 (" in line:
                proc.send_signal(signal.SIGTERM)
                break
        proc.stdout.read()
        assert proc.wait(timeout=240) == 1
    finally:
        proc.kill()
    report = json.loads((out / bundle.JSON_NAME).read_text())
    assert report["terminated"].startswith("SIGTERM") and report["finished_by"] == "SIGTERM"
    assert list(report["sections"]) == SECTIONS
    assert report["sections"]["e2e_smollm2"] == {"status": "error", "seconds": 0.0,
                                                 "error": "interrupted by SIGTERM"}
    assert report["sections"]["decode_trace"]["reason"].startswith("not reached")
    assert_bundle_within_limits(out, report)


def test_prediction_takes_seconds_per_launch_from_the_trace():
    """The trace gives seconds per step per HLO instruction; the model compares per launch."""
    from jaxserve.tools.gpu_check.prediction import per_launch
    from jaxserve.tools.perf_model import KernelCost

    def cost(name, hlo):
        return KernelCost(name=name, hlo=hlo, kind="xla", bytes=1, flops=0)

    costs = [cost("loop_add", "add.1"), cost("loop_add", "add.1"), cost("gemm", "dot.2")]
    got = per_launch({"add.1": 4e-6, "dot.2": 3e-6, "elsewhere.9": 1e-6}, costs)
    assert got == {"add.1": 2e-6, "dot.2": 3e-6}


def test_engine_variant_labels_name_backend_kernels_and_fusion():
    """An e2e variant's backend label: the backend, the Pallas kernels' backend and the fused
    linears (on unless "/unfused"); every label of the GPU profile parses."""
    assert engine_bench.parse_backend("pallas") == ("pallas", "auto", True)
    assert engine_bench.parse_backend("pallas/triton/unfused") == ("pallas", "triton", False)
    assert engine_bench.parse_backend("xla") == ("xla", "auto", True)
    for _, label in profiles.GPU_PROFILE.e2e_variants + profiles.GPU_PROFILE.e2e_variants_8b:
        engine_bench.parse_backend(label)
    with pytest.raises(ValueError, match="unknown backend option"):
        engine_bench.parse_backend("pallas/fast")
