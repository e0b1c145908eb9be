"""Section `launch_floor`: what one kernel costs when it does almost nothing. A jitted chain of
N tiny dependent kernels (an optimization barrier between steps keeps XLA from fusing them; on
a GPU the chain is one CUDA graph) is timed for each N of Profile.launch_chain; the slope
between the shortest and the longest chain is the per-kernel floor, the intercept the per-call
cost. The compiled program's kernel count is checked, so a chain XLA fused shows."""

from __future__ import annotations

import re

from jaxserve.tools.gpu_check.context import Ctx, time_calls

ELEMENTS = 256  # per kernel: far below a wave, so the time is launch and ramp, not work


def chain(n: int):
    """x [ELEMENTS] f32 -> x after n dependent elementwise kernels."""
    import jax

    def fn(x):
        for _ in range(n):
            x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)
        return x
    return jax.jit(fn)


def kernels_in(compiled_text: str) -> int:
    """Fusion instructions (one kernel each) in the optimized program, in whichever
    computation they sit (on a GPU the command-buffer pass moves them out of ENTRY)."""
    return len(re.findall(r"= \S+ fusion\(", compiled_text))


def section_launch_floor(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp
    x = jnp.ones((ELEMENTS,), jnp.float32)  # [E]
    rows, skipped = [], []
    for n in ctx.prof.launch_chain:
        if ctx.over_budget():
            skipped.append({"chain": n, "reason": ctx.budget_reason()})
            continue
        fn = chain(n)
        kernels = kernels_in(fn.lower(x).compile().as_text())
        t = time_calls(fn, [(x,)], max(ctx.prof.iters, 10), ctx.prof.reps)
        rows.append({"chain": n, "kernels_in_program": kernels, "median_s": t["median_s"],
                     "s_per_kernel": t["median_s"] / max(kernels, 1)})
        ctx.log(f"launch chain {n}: {kernels} kernels, {t['median_s'] * 1e6:.1f} us per call")
    res = {"elements": ELEMENTS, "chains": rows, "backend": jax.default_backend()}
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        dk = b["kernels_in_program"] - a["kernels_in_program"]
        if dk > 0:
            res["us_per_kernel"] = (b["median_s"] - a["median_s"]) / dk * 1e6
            res["us_per_call_intercept"] = (a["median_s"] * 1e6
                                            - res["us_per_kernel"] * a["kernels_in_program"])
    if skipped:
        res.update(skipped_chains=skipped, _status="partial", _reason=skipped[0]["reason"])
    elif "us_per_kernel" not in res:
        res.update(_status="failed", _reason="no two chains of different kernel counts")
    return res


def md_launch_floor(r: dict) -> list[str]:
    out = [f"- chain of N tiny dependent kernels ({r['elements']} f32 each), one jitted call: "
           + ", ".join(f"N={c['chain']} ({c['kernels_in_program']} kernels) "
                       f"{c['median_s'] * 1e6:.1f} us" for c in r["chains"])]
    if "us_per_kernel" in r:
        out.append(f"- **{r['us_per_kernel']:.2f} us per kernel** (slope), "
                   f"{r['us_per_call_intercept']:.1f} us per call (intercept)")
    return out
