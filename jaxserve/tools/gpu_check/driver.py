"""The run: arguments, the sections in order, each under the run's budget and its own cap and
on its own (a failure is recorded and the rest still runs), the report written after every
section, and at the end (or when the watchdog fires, or on SIGTERM) the bundle: at most three
files under --out-dir."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pathlib
import sys
import tempfile
import time
import traceback
import warnings

from jaxserve.tools.gpu_check import bundle, guards
from jaxserve.tools.gpu_check.context import Ctx
from jaxserve.tools.gpu_check.decode_trace import section_decode_trace
from jaxserve.tools.gpu_check.engine_bench import section_e2e_llama3_8b, section_e2e_smollm2
from jaxserve.tools.gpu_check.environment import section_bandwidth
from jaxserve.tools.gpu_check.hf_peer import section_hf_peer
from jaxserve.tools.gpu_check.kernel_correctness import section_kernel_correctness
from jaxserve.tools.gpu_check.kernel_tests import section_kernel_tests
from jaxserve.tools.gpu_check.kernel_timings import section_kernel_timings
from jaxserve.tools.gpu_check.launch_floor import section_launch_floor
from jaxserve.tools.gpu_check.llm_defaults import section_llm_defaults
from jaxserve.tools import cuda_plugin
from jaxserve.tools.gpu_check.prediction import section_prediction
from jaxserve.tools.gpu_check.preflight import section_preflight
from jaxserve.tools.gpu_check.profiles import (DRY_BUDGET_S, DRY_PROFILE, GPU_BUDGET_S,
                                               GPU_PROFILE, SECTION_GRACE_S, WATCHDOG_GRACE_S)
from jaxserve.tools.gpu_check.report import markdown, write_report
from jaxserve.tools.gpu_check.step_dump import (enable_step_dump, section_step_dump,
                                                stderr_log, traced_dump_names)

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

DESCRIPTION = "GPU check: the one prepared script to run when an H200 is lent (see docs/gpu.md)."


# Preflight first (no GPU: stop); the kernels' correctness and their compiled tests before any
# timing; SmolLM2 (the served model) and its trace before the costlier 8B model, both before
# the plain-defaults run and the HF peer (the first to give way to the budget); the dump
# summary and the performance model's prediction last, since they read what the others left.
SECTIONS = [("preflight", section_preflight), ("bandwidth", section_bandwidth),
            ("kernel_correctness", section_kernel_correctness),
            ("kernel_tests", section_kernel_tests), ("kernel_timings", section_kernel_timings),
            ("launch_floor", section_launch_floor), ("e2e_smollm2", section_e2e_smollm2),
            ("decode_trace", section_decode_trace), ("e2e_llama3_8b", section_e2e_llama3_8b),
            ("llm_defaults", section_llm_defaults), ("hf_peer", section_hf_peer),
            ("step_dump", section_step_dump), ("prediction", section_prediction)]
# Cheap and needed to read the rest: these run even past the budget (under their own cap).
# prediction reads the traced step's dump on a GPU (seconds); a dry run compiles one deviceless.
ALWAYS = {"preflight": 30.0, "step_dump": 30.0, "prediction": 45.0}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "seconds": 0.0, "reason": reason}


def run_section(ctx: Ctx, name: str, fn) -> dict:
    if ctx.over_budget() and name not in ALWAYS:
        return skipped(f"time budget ({ctx.args.time_budget:.0f}s) exceeded before this section")
    need = dict(ctx.prof.section_min_s).get(name, 0.0)
    if need and ctx.remaining() < need:
        return skipped(f"time budget: this section needs about {need:.0f}s, "
                       f"{ctx.remaining():.0f}s left")
    cap = ALWAYS.get(name) or dict(ctx.prof.section_cap_s).get(name)
    ctx.enter_section(name, cap)
    hard = ctx.remaining() + SECTION_GRACE_S
    ctx.log(f"section {name} (cap {cap or 'none'}, hard stop in {hard:.0f}s) ...")
    t0 = time.monotonic()
    guards.arm_section(hard)
    try:
        result = fn(ctx)
        guards.arm_section(None)
        status = result.pop("_status", "ok")
        sec = {"status": status, "result": result}
        if "_reason" in result:
            sec["reason"] = result.pop("_reason")
    except guards.SectionTimeout:
        sec = {"status": "error", "error": f"interrupted at its hard stop ({hard:.0f}s: "
                                           f"{ctx.budget_reason()} + {SECTION_GRACE_S:.0f}s)"}
    except Exception as e:  # noqa: BLE001 - one section failing must not stop the others
        guards.arm_section(None)
        sec = {"status": "error", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    finally:
        guards.arm_section(None)
        ctx.leave_section()
    sec["seconds"] = time.monotonic() - t0
    if name == "decode_trace" or sec["status"] == "error":
        ctx.trace_engine = None  # an engine left behind holds device memory
    gc.collect()
    ctx.log(f"section {name}: {sec['status']} in {sec['seconds']:.1f}s"
            + (f" ({sec.get('error') or sec.get('reason')})" if sec["status"] != "ok" else ""))
    return sec


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--out-dir", default="gpu_check_out",
                    help="where the three result files go ($OUT on the lent machine)")
    ap.add_argument("--scratch-dir", default=None,
                    help="where dumps and traces are written first (default: a new temporary "
                         "folder); must not be inside --out-dir")
    ap.add_argument("--gguf", default=None, help="SmolLM2 .gguf file (else random weights)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the sections; checked between sections and inside their "
                         "loops, each section also under its own cap; what would start after "
                         f"it is skipped. Default {GPU_BUDGET_S:.0f} on a GPU, "
                         f"{DRY_BUDGET_S:.0f} in a dry run. A watchdog writes the bundle and "
                         f"exits at budget + {WATCHDOG_GRACE_S:.0f}s")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, interpret-mode kernels, tiny shapes and models")
    ap.add_argument("--no-step-dump", action="store_true",
                    help="do not dump the compiled engine step (XLA_FLAGS)")
    ap.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                    help="comma-separated subset of sections to run (the others are recorded "
                         "as skipped)")
    args = ap.parse_args(argv)
    if args.time_budget is None:
        args.time_budget = DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S
    unknown = set(args.sections.split(",")) - {n for n, _ in SECTIONS}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {[n for n, _ in SECTIONS]}")
    out = pathlib.Path(args.out_dir).resolve()
    if args.scratch_dir:
        scratch = pathlib.Path(args.scratch_dir).resolve()
        if scratch == out or out in scratch.parents:
            ap.error(f"--scratch-dir {scratch} is inside --out-dir {out}: only the bundle "
                     "may go there")
    return args


def make_dirs(args) -> tuple[pathlib.Path, pathlib.Path]:
    """(out dir, scratch dir); our own files left in the out dir by an earlier run removed."""
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in (bundle.JSON_NAME, bundle.MD_NAME, bundle.TAR_NAME):
        (out / name).unlink(missing_ok=True)
    if args.scratch_dir:
        scratch = pathlib.Path(args.scratch_dir)
        scratch.mkdir(parents=True, exist_ok=True)
    else:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
    return out, scratch


def finish(ctx: Ctx, report: dict, out: pathlib.Path, how: str) -> list[str]:
    """The final report, its markdown and the bundle; returns the out dir's limit problems."""
    report["finished_by"] = how
    report["elapsed_s"] = time.monotonic() - ctx.start
    for name, _ in SECTIONS:  # every section has a status, also when the run was cut short
        report["sections"].setdefault(name, skipped(f"not reached (run ended: {how})"))
    write_report(out, report)
    (out / bundle.MD_NAME).write_text(markdown(report))
    variants = [m for mods in ctx.step_modules.values() for m in mods]
    try:
        man = bundle.build_bundle(out, ctx.scratch,
                                  traced_dump_names(ctx.decode_trace.get("modules", {})),
                                  variants)
        report["bundle"] = {"tar": bundle.TAR_NAME, "tar_bytes": man["tar_bytes"],
                            "included": len(man["included"]),
                            "included_names": [m["name"] for m in man["included"]][:60],
                            "truncated": man["truncated"], "left_out": man["left_out"][:40],
                            "scratch_dir": str(ctx.scratch)}
    except Exception as e:  # noqa: BLE001 - the JSON and markdown still come back
        report["bundle"] = {"error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-2000:]}
    report["bundle"]["out_dir_problems"] = bundle.out_dir_problems(out)
    write_report(out, report)
    md = markdown(report)
    (out / bundle.MD_NAME).write_text(md)
    problems = bundle.out_dir_problems(out)
    print(md, flush=True)
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        # The CUDA compiler plugin setup installs beside .venv (before jax is imported): the
        # dry run's prediction compiles the traced step for an H200 deviceless.
        cuda_plugin.use_setup_plugin()
    out, scratch = make_dirs(args)
    tee = guards.StderrTee(stderr_log(scratch)).start()
    print(f"gpu_check: dumps, trace and this stderr go to {scratch} first; results to {out}",
          file=sys.stderr, flush=True)
    # XLA reads its flags once, when jax starts the backend.
    ptxas_note = enable_step_dump(args, scratch)
    guards.install_handlers()
    ctx = Ctx(args, DRY_PROFILE if args.dry_run else GPU_PROFILE, scratch)
    ctx.ptxas_note = ptxas_note
    wanted = set(args.sections.split(","))
    report = {"command": " ".join([sys.executable] + sys.argv), "dry_run": args.dry_run,
              "time_budget_s": args.time_budget, "profile": dataclasses.asdict(ctx.prof),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    ctx.report = report

    def on_watchdog():
        running = report.get("running")
        if running:
            report["sections"][running] = {"status": "error", "seconds": 0.0,
                                           "error": "stopped by the watchdog (run budget + "
                                                    f"{WATCHDOG_GRACE_S:.0f}s)"}
        finish(ctx, report, out, "watchdog")

    watchdog = guards.Watchdog(args.time_budget + WATCHDOG_GRACE_S, on_watchdog).start()
    stop = None
    try:
        for name, fn in SECTIONS:
            if name not in wanted:
                report["sections"][name] = skipped("not selected (--sections)")
            elif stop:
                report["sections"][name] = skipped(stop)
            else:
                report["running"] = name
                report["sections"][name] = run_section(ctx, name, fn)
                report.pop("running")
            report["elapsed_s"] = time.monotonic() - ctx.start
            write_report(out, report)
            pre = report["sections"][name]
            if name == "preflight" and pre["status"] in ("failed", "error"):
                stop = "preflight: " + (pre.get("reason") or pre.get("error") or "failed")
    except guards.Terminated:
        report["terminated"] = "SIGTERM: the sections after the running one did not run"
        running = report.pop("running", None)
        if running:
            report["sections"][running] = {"status": "error", "seconds": 0.0,
                                           "error": "interrupted by SIGTERM"}
    problems = []
    if watchdog.cancel():
        problems = finish(ctx, report, out, "sections done" if "terminated" not in report
                          else "SIGTERM")
    tee.stop()
    if stop:
        print(f"gpu_check: {stop}", file=sys.stderr)
        return 2
    bad = [n for n, s in report["sections"].items() if s["status"] in ("error", "failed")]
    if bad:
        print(f"gpu_check: problems in {bad}", file=sys.stderr)
    if problems:
        print(f"gpu_check: the out dir breaks the return limits: {problems}", file=sys.stderr)
    return 1 if bad or problems or "terminated" in report else 0
