"""A jax.profiler trace read back through jax's public `jax.profiler.ProfileData`: the device's
kernels (or, on CPU, the XLA runtime's thunks) with their times, summarised into per-kernel
device seconds per step, busy time against wall time, and the gaps between kernels.

On a GPU the kernels are the events of the `/device:GPU:N` planes' stream lines (CUPTI's
activity records; the profiler's derived lines such as "XLA Ops" are skipped, they repeat the
same time). On CPU there is no device plane: the host plane's events carrying an `hlo_op` stat
(one per executed thunk) stand in, so the dry run exercises the same reading."""

from __future__ import annotations

import pathlib
import statistics

# Lines the profiler derives from the kernels (they repeat the kernels' time, not add to it).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Name Scope",
                 "Framework Ops", "Source code", "Launch Stats", "TensorFlow Name Scope",
                 "TensorFlow Ops")
TOP_KERNELS = 15


def find_xspace(trace_dir: pathlib.Path) -> pathlib.Path | None:
    """The newest `*.xplane.pb` the profiler wrote under trace_dir."""
    found = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    return found[-1] if found else None


def kernel_events(profile, host_fallback: bool) -> tuple[list[dict], str]:
    """[{name, op, module, program_id, start_ns, dur_ns}] and where they came from. Without a
    GPU plane, the host's thunk events stand in only where host_fallback (a CPU run): on a GPU
    they would be launch times passed off as kernel times."""
    gpu = [p for p in profile.planes if p.name.startswith("/device:GPU")]
    out = []
    if gpu:
        for plane in gpu:
            for line in plane.lines:
                if line.name in DERIVED_LINES:
                    continue
                out += [_event(e, plane.name) for e in line.events]
        return out, "gpu device planes (CUPTI kernels)"
    if not host_fallback:
        return [], "no /device:GPU plane in the trace (CUPTI unavailable?)"
    for plane in profile.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                ev = _event(e, plane.name)
                if ev["op"] is not None:
                    out.append(ev)
    return out, "host plane: XLA CPU thunks (no device plane)"


def _event(e, plane: str) -> dict:
    stats = dict(e.stats)
    op = stats.get("hlo_op")
    return {"name": e.name, "op": op, "module": stats.get("hlo_module"),
            "program_id": stats.get("program_id"), "start_ns": float(e.start_ns),
            "dur_ns": float(e.duration_ns), "plane": plane}


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the events' [start, end) intervals, merged and sorted."""
    merged: list[list[float]] = []
    for e in sorted(events, key=lambda e: e["start_ns"]):
        start, end = e["start_ns"], e["start_ns"] + e["dur_ns"]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarise(events: list[dict], steps: int) -> dict:
    """Per-kernel seconds per step (key: the HLO instruction the kernel runs, else its name),
    busy vs wall, the gaps between kernels, the top kernels by time. `steps` divides the
    totals: the number of engine steps the trace covered."""
    if not events:
        return {"events": 0, "steps": steps, "per_kernel_s": {}}
    steps = max(1, steps)
    spans = busy_intervals(events)
    wall_ns = spans[-1][1] - spans[0][0]
    busy_ns = sum(b - a for a, b in spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]  # idle device between kernels
    per_key: dict[str, dict] = {}
    for e in events:
        key = e["op"] or e["name"]
        row = per_key.setdefault(key, {"kernel": key, "names": set(), "count": 0, "total_ns": 0.0})
        row["names"].add(e["name"])
        row["count"] += 1
        row["total_ns"] += e["dur_ns"]
    rows = sorted(per_key.values(), key=lambda r: -r["total_ns"])
    top = [{"kernel": r["kernel"], "names": sorted(r["names"])[:3],
            "per_step": r["count"] / steps, "mean_us": r["total_ns"] / r["count"] / 1e3,
            "s_per_step": r["total_ns"] / steps / 1e9, "share_of_busy": r["total_ns"] / busy_ns
            if busy_ns else 0.0} for r in rows[:TOP_KERNELS]]
    modules: dict[str, int] = {}
    for e in events:
        if e["module"] is not None:
            label = f"{e['module']}#{e['program_id']}"
            modules[label] = modules.get(label, 0) + 1
    return {"events": len(events), "steps": steps, "kernels_per_step": len(events) / steps,
            "distinct_kernels": len(per_key), "wall_s": wall_ns / 1e9, "busy_s": busy_ns / 1e9,
            "busy_fraction": busy_ns / wall_ns if wall_ns else 1.0,
            "busy_s_per_step": busy_ns / steps / 1e9, "wall_s_per_step": wall_ns / steps / 1e9,
            "gaps": _gap_stats(gaps, steps), "top": top,
            # kernel (HLO instruction) -> measured device seconds per step: what a performance
            # model's per-kernel prediction is compared with.
            "per_kernel_s": {r["kernel"]: r["total_ns"] / steps / 1e9 for r in rows},
            "modules": modules}


def _gap_stats(gaps: list[float], steps: int) -> dict:
    if not gaps:
        return {"count": 0}
    ordered = sorted(gaps)
    return {"count": len(gaps), "mean_us": statistics.fmean(gaps) / 1e3,
            "median_us": statistics.median(gaps) / 1e3,
            "p90_us": ordered[int(0.9 * (len(ordered) - 1))] / 1e3, "max_us": ordered[-1] / 1e3,
            "total_s_per_step": sum(gaps) / steps / 1e9,
            "note": "idle device time between consecutive kernels; the largest are usually the "
                    "host's work between steps"}


def read_trace(trace_dir: pathlib.Path, steps: int) -> dict:
    """The summary of the newest trace under trace_dir (see `summarise`); an error when it
    holds no kernel events."""
    import jax
    path = find_xspace(trace_dir)
    if path is None:
        return {"error": f"no *.xplane.pb under {trace_dir}"}
    profile = jax.profiler.ProfileData.from_file(str(path))
    events, source = kernel_events(profile, host_fallback=jax.default_backend() == "cpu")
    res = {"xspace": path.name, "xspace_bytes": path.stat().st_size, "source": source,
           "planes": [p.name for p in profile.planes], **summarise(events, steps)}
    if not events:
        res["error"] = f"no kernel events in {path.name}: {source}"
    return res
