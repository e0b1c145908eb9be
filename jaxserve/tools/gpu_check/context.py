"""Run state shared by the sections (budget, measured bandwidth, cached kernel inputs) and the
helpers every section uses: timing calls on the device, rates against the nominal and measured
bandwidth, running cases one by one under the budget.

The budget has two levels: the run's deadline (--time-budget) and the running section's own
cap (Profile.section_cap_s); `over_budget` and `remaining` answer for the nearer of the two, so
every loop that checks them stops at whichever comes first."""

from __future__ import annotations

import statistics
import time
import traceback

from jaxserve.tools.gpu_check.profiles import NOMINAL_BF16_FLOPS, NOMINAL_BW, Profile


class Ctx:
    """Run state shared by the sections."""

    def __init__(self, args, prof: Profile, scratch=None):
        self.args, self.prof = args, prof
        self.scratch = scratch      # pathlib.Path: dumps and traces, outside the out dir
        self.start = time.monotonic()
        self.run_deadline = self.start + args.time_budget
        self.deadline = self.run_deadline  # the nearer of the run's and the section's
        self.section_cap: tuple[str, float] | None = None  # (section, cap s) while one runs
        self.bandwidth: dict = {}   # measured copy/read B/s (bandwidth section)
        self.cases: dict = {}       # kernel inputs shared by correctness and timings
        self.engine_results: dict = {}
        self.trace_engine = None    # e2e_smollm2's Pallas bf16 engine, kept for decode_trace
        self.step_modules: dict = {}  # engine variant -> XLA dump module ids it compiled
        self.decode_trace: dict = {}  # decode_trace's per-kernel summary, for prediction
        self.trace_shape: dict = {}  # the traced engine's model config and cache shape
        self.report: dict = {}      # the report so far (the driver's), read by `prediction`
        self.ptxas_note: str | None = None  # why no ptxas -v report is captured, if none is

    def enter_section(self, name: str, cap_s: float | None) -> None:
        now = time.monotonic()
        capped = cap_s is not None
        self.section_cap = (name, cap_s) if capped else None
        self.deadline = min(self.run_deadline, now + cap_s) if capped else self.run_deadline

    def leave_section(self) -> None:
        self.section_cap, self.deadline = None, self.run_deadline

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def budget_reason(self) -> str:
        """Why over_budget() holds: the run's budget or the section's cap."""
        if self.section_cap and self.deadline < self.run_deadline:
            return f"section cap ({self.section_cap[1]:.0f}s for {self.section_cap[0]}) reached"
        return f"time budget ({self.args.time_budget:.0f}s) exceeded"

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
    """Runs fn(ctx, *key) per key; one failing case is recorded, the rest still run. A case
    that would start past the budget is skipped: skipped holds {case, reason} each."""
    rows, skipped = [], []
    for key in keys:
        if ctx.over_budget():
            skipped.append({"case": list(key), "what": what, "reason": ctx.budget_reason()})
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
