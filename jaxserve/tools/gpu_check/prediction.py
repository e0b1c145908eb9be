"""Section `prediction`: the hook where a deviceless performance model's predicted step and
per-kernel times are set beside the measured ones. Not wired yet: it records "not wired" and
what the measured side offers, so the model can be connected without touching the sections.

To wire it, set PREDICTOR to a function `predict(measured: dict) -> dict` (e.g. from
jaxserve/tools/perf_model.py); `measured` is `measured_side(ctx)`: the traced decode step's
per-kernel device seconds (kernel name -> seconds per step), its busy and wall time per step,
the launch floor, the measured bandwidth and matmul rate, the step dump folder and the dump
modules of each engine variant and of the traced step."""

from __future__ import annotations

from jaxserve.tools.gpu_check.context import Ctx
from jaxserve.tools.gpu_check.step_dump import dump_dir

PREDICTOR = None  # not wired: see the module docstring
# Where gpu_check.json holds the measured kernel -> device seconds per step of the traced step.
PER_KERNEL_AT = "sections.decode_trace.result.trace.per_kernel_s"


def measured_side(ctx: Ctx) -> dict:
    """What a prediction is compared with, from the sections that ran before."""
    sections = ctx.report.get("sections", {})
    trace = ctx.decode_trace
    floor = sections.get("launch_floor", {}).get("result", {})
    trace_sec = sections.get("decode_trace", {}).get("result", {})
    return {"traced_engine": trace_sec.get("engine"), "traced_batch": trace_sec.get("batch"),
            "per_kernel_s": trace.get("per_kernel_s", {}),
            "busy_s_per_step": trace.get("busy_s_per_step"),
            "wall_s_per_step": trace.get("wall_s_per_step"),
            "traced_modules": trace.get("modules", {}),
            "launch_floor_us_per_kernel": floor.get("us_per_kernel"),
            "bandwidth_Bps": dict(ctx.bandwidth),
            "step_dump_dir": str(dump_dir(ctx.scratch)) if ctx.scratch else None,
            "variant_modules": dict(ctx.step_modules)}


def section_prediction(ctx: Ctx) -> dict:
    measured = measured_side(ctx)
    ready = {k: bool(v) for k, v in measured.items()}
    if PREDICTOR is None:
        return {"_status": "skipped", "_reason": "not wired: no performance model connected",
                "wired": False, "measured_ready": ready, "measured_keys": sorted(measured),
                "per_kernel_s_at": PER_KERNEL_AT}
    return {"wired": True, "measured_ready": ready, "prediction": PREDICTOR(measured)}


def md_prediction(r: dict) -> list[str]:
    return [f"- wired: {r.get('wired')}; measured inputs present: "
            + ", ".join(k for k, v in r.get("measured_ready", {}).items() if v)]
