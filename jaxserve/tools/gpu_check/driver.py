"""The run: arguments, the sections in order, each under the time budget and on its own (a
failure is recorded and the rest still runs), the report written as it goes."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pathlib
import sys
import time
import traceback
import warnings

from jaxserve.tools.gpu_check.context import Ctx
from jaxserve.tools.gpu_check.engine_bench import section_e2e_llama3_8b, section_e2e_smollm2
from jaxserve.tools.gpu_check.environment import section_bandwidth, section_environment
from jaxserve.tools.gpu_check.hf_peer import section_hf_peer
from jaxserve.tools.gpu_check.kernel_correctness import section_kernel_correctness
from jaxserve.tools.gpu_check.kernel_tests import section_kernel_tests
from jaxserve.tools.gpu_check.kernel_timings import section_kernel_timings
from jaxserve.tools.gpu_check.llm_defaults import section_llm_defaults
from jaxserve.tools.gpu_check.profiles import DRY_BUDGET_S, DRY_PROFILE, GPU_BUDGET_S, GPU_PROFILE
from jaxserve.tools.gpu_check.report import markdown, write_report
from jaxserve.tools.gpu_check.step_dump import enable_step_dump, section_step_dump

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

DESCRIPTION = "GPU check: the one prepared script to run when an H200 is lent (see docs/gpu.md)."


# Cheapest and most needed first: SmolLM2 (the served model) before the 8B model, whose random
# init and compiles cost the most; the dump of the steps compiled so far after both.
SECTIONS = [("environment", section_environment), ("bandwidth", section_bandwidth),
            ("kernel_correctness", section_kernel_correctness),
            ("kernel_timings", section_kernel_timings),
            ("e2e_smollm2", section_e2e_smollm2), ("llm_defaults", section_llm_defaults),
            ("e2e_llama3_8b", section_e2e_llama3_8b), ("step_dump", section_step_dump),
            ("hf_peer", section_hf_peer), ("kernel_tests", section_kernel_tests)]


def run_section(ctx: Ctx, name: str, fn) -> dict:
    if ctx.over_budget() and name not in ("environment", "step_dump"):
        return {"status": "skipped", "seconds": 0.0,
                "reason": f"time budget ({ctx.args.time_budget:.0f}s) exceeded before this section"}
    need = dict(ctx.prof.section_min_s).get(name, 0.0)
    if need and ctx.remaining() < need:
        return {"status": "skipped", "seconds": 0.0,
                "reason": f"time budget: this section needs about {need:.0f}s, "
                          f"{ctx.remaining():.0f}s left"}
    ctx.log(f"section {name} ...")
    t0 = time.monotonic()
    try:
        result = fn(ctx)
        status = result.pop("_status", "ok")
        sec = {"status": status, "result": result}
        if "_reason" in result:
            sec["reason"] = result.pop("_reason")
    except Exception as e:  # noqa: BLE001 - one section failing must not stop the others
        sec = {"status": "error", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    sec["seconds"] = time.monotonic() - t0
    gc.collect()
    ctx.log(f"section {name}: {sec['status']} in {sec['seconds']:.1f}s"
            + (f" ({sec.get('error') or sec.get('reason')})" if sec["status"] != "ok" else ""))
    return sec


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--out-dir", default="gpu_check_out")
    ap.add_argument("--gguf", default=None, help="SmolLM2 .gguf file (else random weights)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; checked between sections, cases, variants and batches: what "
                         f"would start after it is skipped. Default {GPU_BUDGET_S:.0f} on a GPU "
                         f"(with start-up, one call fits 8 min), {DRY_BUDGET_S:.0f} in a dry run")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, interpret-mode kernels, tiny shapes and models")
    ap.add_argument("--no-step-dump", action="store_true",
                    help="do not dump the compiled engine step (XLA_FLAGS) under --out-dir")
    ap.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                    help="comma-separated subset of sections to run")
    args = ap.parse_args(argv)
    if args.time_budget is None:
        args.time_budget = DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S
    unknown = set(args.sections.split(",")) - {n for n, _ in SECTIONS}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {[n for n, _ in SECTIONS]}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    enable_step_dump(args)  # XLA reads its flags once, when jax starts the backend
    import jax
    if not args.dry_run and jax.default_backend() != "gpu":
        print(f"gpu_check: no GPU (jax backend {jax.default_backend()!r}); use --dry-run",
              file=sys.stderr)
        return 2
    ctx = Ctx(args, DRY_PROFILE if args.dry_run else GPU_PROFILE)
    wanted = set(args.sections.split(","))
    out_dir = pathlib.Path(args.out_dir)
    report = {"command": " ".join([sys.executable] + sys.argv), "dry_run": args.dry_run,
              "time_budget_s": args.time_budget, "profile": dataclasses.asdict(ctx.prof),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    for name, fn in SECTIONS:
        if name in wanted:
            report["sections"][name] = run_section(ctx, name, fn)
            report["elapsed_s"] = time.monotonic() - ctx.start
            write_report(out_dir, report)
    md = markdown(report)
    (out_dir / "gpu_check.md").write_text(md)
    print(md, flush=True)
    bad = [n for n, s in report["sections"].items() if s["status"] in ("error", "failed")]
    if bad:
        print(f"gpu_check: problems in {bad}", file=sys.stderr)
    return 1 if bad else 0
