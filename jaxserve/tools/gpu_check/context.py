"""Run state shared by the sections (budget, measured bandwidth, cached kernel inputs) and the
helpers every section uses: timing calls on the device, rates against the nominal and measured
bandwidth, running cases one by one under the budget."""

from __future__ import annotations

import statistics
import time
import traceback

from jaxserve.tools.gpu_check.profiles import NOMINAL_BF16_FLOPS, NOMINAL_BW, Profile


class Ctx:
    """Run state shared by the sections."""

    def __init__(self, args, prof: Profile):
        self.args, self.prof = args, prof
        self.start = time.monotonic()
        self.deadline = self.start + args.time_budget
        self.bandwidth: dict = {}   # measured copy/read B/s (bandwidth section)
        self.cases: dict = {}       # kernel inputs shared by correctness and timings
        self.engine_results: dict = {}

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[gpu_check {time.monotonic() - self.start:6.1f}s] {msg}", flush=True)


def time_calls(fn, arg_sets, iters: int, reps: int) -> dict:
    """Median seconds per call: `iters` back-to-back calls cycling over `arg_sets`, then one
    block_until_ready (the device runs them in order), `reps` samples. First call warms up."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    first = time.perf_counter() - t0
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "first_call_s": first}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rates(ctx: Ctx, seconds: float, nbytes: int, flops: int | None = None) -> dict:
    out = {"median_s": seconds, "bytes_per_s": nbytes / seconds,
           "vs_nominal_bw": nbytes / seconds / NOMINAL_BW}
    for kind in ("copy", "read"):
        if ctx.bandwidth.get(kind):
            out[f"vs_measured_{kind}_bw"] = nbytes / seconds / ctx.bandwidth[kind]
    if flops:
        out["flops_per_s"] = flops / seconds
        out["vs_nominal_bf16_flops"] = flops / seconds / NOMINAL_BF16_FLOPS
    return out


def importable(name: str) -> str | None:
    """None when `name` imports, else the reason it does not."""
    try:
        __import__(name)
        return None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return f"{type(e).__name__}: {e}"


def run_cases(ctx: Ctx, keys, fn, what: str) -> tuple[list, list]:
    """Runs fn(ctx, *key) per key; one failing case is recorded, the rest still run."""
    rows, skipped = [], []
    for key in keys:
        if ctx.over_budget():
            skipped.append(list(key))
            continue
        try:
            rows.append(fn(ctx, *key))
        except Exception as e:  # noqa: BLE001 - recorded per case
            rows.append({"case": list(key), "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]})
        ctx.log(f"{what} {key}: {summarise_row(rows[-1])}")
    return rows, skipped


def summarise_row(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:200]
    if "within_tol" in row:
        return f"max_abs_err={row['max_abs_err']:.3g} ok={row['within_tol']}"
    return f"kernel {row['kernel']['median_s'] * 1e6:.1f} us"
