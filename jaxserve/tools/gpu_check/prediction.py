"""Section `prediction`: the deviceless performance model (jaxserve/tools/perf_model.py) beside
the measured decode step.

The traced step's compiled program is costed kernel by kernel from its own XLA dump (on a GPU
the run dumps every step module; `traced_dump_names` maps the trace to its module), predicted
with the H200 constants, and compared per kernel with the trace's device times. With >= 3
kernels matched, the model's constants are fitted to the trace (`perf_model.fit`: ramp,
memory and FLOP efficiency, the trace's median gap as the launch gap) and the step predicted
again with them: the fitted constants are what docs/perf_model.md should then quote.

A CPU dry run has no GPU dump of its traced step (its dump is XLA:CPU's); it compiles the
traced model's decode step for an H200 deviceless instead (when the CUDA plugin is installed),
so every part of the section runs; its CPU trace matches none of the GPU kernels, so nothing is
fitted there."""

from __future__ import annotations

from jaxserve.tools.gpu_check.context import Ctx
from jaxserve.tools.gpu_check.step_dump import dump_dir, traced_dump_names

# Where gpu_check.json holds the measured kernel -> device seconds per step of the traced step.
PER_KERNEL_AT = "sections.decode_trace.result.trace.per_kernel_s"
TOP_KERNELS = 20  # per-kernel rows kept in the report, by predicted time


def measured_side(ctx: Ctx) -> dict:
    """What a prediction is compared with, from the sections that ran before."""
    sections = ctx.report.get("sections", {})
    trace = ctx.decode_trace
    floor = sections.get("launch_floor", {}).get("result", {})
    trace_sec = sections.get("decode_trace", {}).get("result", {})
    return {"traced_engine": trace_sec.get("engine"), "traced_batch": trace_sec.get("batch"),
            "context_len": trace_sec.get("context_len"),
            "weight_bytes": trace_sec.get("weight_bytes"),
            "per_kernel_s": trace.get("per_kernel_s", {}),
            "busy_s_per_step": trace.get("busy_s_per_step"),
            "wall_s_per_step": trace.get("wall_s_per_step"),
            "median_gap_us": trace.get("gaps", {}).get("median_us"),
            "traced_modules": trace.get("modules", {}),
            "launch_floor_us_per_kernel": floor.get("us_per_kernel"),
            "bandwidth_Bps": dict(ctx.bandwidth),
            "step_dump_dir": str(dump_dir(ctx.scratch)) if ctx.scratch else None,
            "variant_modules": dict(ctx.step_modules)}


def traced_costs(measured: dict):
    """(costs, source) of the traced step from its own GPU dump, else (None, why not)."""
    from jaxserve.tools import perf_model
    names = traced_dump_names(measured["traced_modules"])
    if not names or not measured["step_dump_dir"]:
        return None, "the trace names no dumped step module"
    why = []
    for name in names:
        try:
            return perf_model.kernel_costs(measured["step_dump_dir"], name,
                                           context_len=measured["context_len"],
                                           rows=measured["traced_batch"]), f"dump {name}"
        except (FileNotFoundError, ValueError) as e:
            why.append(f"{name}: {e}")
    return None, "; ".join(why)


def deviceless_costs(ctx: Ctx, measured: dict):
    """(costs, source) from an H200 compile, here, of the traced model's decode step."""
    from jaxserve.tools import deviceless, gpu_step
    why = deviceless.unavailable_reason()
    if why:
        return None, f"no deviceless compile: {why}"
    shape = ctx.trace_shape
    rows = measured["traced_batch"]
    spec = gpu_step.StepSpec(config=shape["config"], tokens=rows,
                             max_num_seqs=shape["max_num_seqs"],
                             max_model_len=shape["max_model_len"],
                             block_size=shape["block_size"],
                             context_len=min(measured["context_len"], shape["max_model_len"]))
    _, extra = gpu_step.step_report(spec)
    return extra["kernel_costs"], f"deviceless H200 compile of the traced model's {rows}-token step"


def per_launch(per_kernel_s: dict[str, float], costs) -> dict[str, float]:
    """The trace's seconds per step per HLO instruction -> seconds per launch (what
    perf_model.fit and compare take), using the launches per step the program makes."""
    launches: dict[str, int] = {}
    for c in costs:
        for key in {c.hlo, c.name} - {None}:
            launches[key] = launches.get(key, 0) + 1
    return {k: s / launches[k] for k, s in per_kernel_s.items() if launches.get(k)}


def section_prediction(ctx: Ctx) -> dict:
    from jaxserve.tools import perf_model
    measured = measured_side(ctx)
    if not measured["traced_batch"] or not measured["weight_bytes"]:
        return {"_status": "skipped", "_reason": "decode_trace did not run: nothing to compare"}
    costs, source = traced_costs(measured)
    if costs is None and ctx.args.dry_run:
        costs, source = deviceless_costs(ctx, measured)
    if costs is None:
        return {"_status": "skipped", "_reason": source}
    hw, rows = perf_model.H200, measured["traced_batch"]
    pred = perf_model.predict(costs, hw, tokens=rows, weight_bytes=measured["weight_bytes"])
    measured_launch = per_launch(measured["per_kernel_s"], costs)
    rows_by_kernel = perf_model.compare(costs, measured_launch, hw)
    top = sorted(rows_by_kernel.items(), key=lambda kv: -kv[1]["predicted_us"] * kv[1]["launches"])
    out = {"source": source, "hardware": hw.name, "kernels": len(costs),
           "matched_kernels": sum(1 for r in rows_by_kernel.values() if r["measured_us"] is not None),
           "predicted": _summary(pred),
           "measured": {"busy_s_per_step": measured["busy_s_per_step"],
                        "wall_s_per_step": measured["wall_s_per_step"]},
           "per_kernel": dict(top[:TOP_KERNELS])}
    gap = measured["median_gap_us"]
    try:
        fitted = perf_model.fit(costs, measured_launch, hw,
                                gap_s=None if gap is None else gap * 1e-6)
    except ValueError as e:  # fewer than 3 kernels of the step matched in the trace
        out["fit"] = {"skipped": str(e)}
        return out
    refit = perf_model.predict(costs, fitted, tokens=rows, weight_bytes=measured["weight_bytes"])
    out["fit"] = {"constants": {k: getattr(fitted, k) for k in (
        "launch_s", "ramp_s", "mem_efficiency", "flop_efficiency")},
        "predicted": _summary(refit)}
    return out


def _summary(p) -> dict:
    return {"step_us": p.step_s * 1e6, "tokens_per_s": p.tokens_per_s, "mbu": p.mbu,
            "floor_us": p.floor_s * 1e6, "overhead_us": p.overhead_s * 1e6, "kernels": p.kernels}


def md_prediction(r: dict) -> list[str]:
    p = r["predicted"]
    lines = [f"- {r['source']}: {r['kernels']} kernels, {r['matched_kernels']} matched in the "
             f"trace; predicted ({r['hardware']} constants) {p['step_us']:.0f} us/step, "
             f"MBU {p['mbu']:.0%}; measured busy "
             f"{(r['measured']['busy_s_per_step'] or 0) * 1e6:.0f} us/step"]
    fit = r.get("fit", {})
    if "constants" in fit:
        c = fit["constants"]
        lines.append(f"- fitted: launch {c['launch_s'] * 1e6:.2f} us, ramp {c['ramp_s'] * 1e6:.2f}"
                     f" us, memory efficiency {c['mem_efficiency']:.2f}, FLOP efficiency "
                     f"{c['flop_efficiency']:.2f} -> {fit['predicted']['step_us']:.0f} us/step")
    elif fit:
        lines.append(f"- not fitted: {fit['skipped']}")
    return lines
