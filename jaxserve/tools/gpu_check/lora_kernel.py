"""The multi-LoRA (SGMV) kernel in the GPU check: its inputs at engine sizes, its correctness
against the reference (section kernel_correctness) and its timing beside the XLA paths
(section kernel_timings). A case is (model, K, N, tokens M, adapter slots S, rank R), bf16."""

from __future__ import annotations

import math
import zlib

from jaxserve.tools.gpu_check.context import Ctx, rates, time_calls
from jaxserve.tools.gpu_check.profiles import L2_BYTES


def lora_inputs(ctx: Ctx, model: str, k: int, n: int, m: int, s: int, r: int) -> dict:
    """The kernel tests' case (pallas_kernels/cases.py: rows of no adapter and empty slots'
    weights NaN) for a random batch of m tokens over s slots, in as many copies as make the
    timed reads exceed 2x L2. bytes_per_call: x, the used slots' a and b, the f32 result."""
    import numpy as np
    from pallas_kernels.cases import lora_batch_sizes, lora_case
    key = ("lora", model, k, n, m, s, r)
    if key in ctx.cases:
        return ctx.cases[key]
    seed = zlib.crc32(repr(key).encode())
    sizes, extra = lora_batch_sizes(m, s, seed)
    used = sum(1 for v in sizes if v)
    nbytes = m * k * 2 + used * (k + n) * r * 2 + m * n * 4
    copies = int(min(ctx.prof.max_copies, max(1, math.ceil(2 * L2_BYTES / nbytes))))
    sets = [lora_case(seed + i, sizes=sizes, rank=r, k=k, n=n, dtype="bfloat16",
                      extra_rows=extra) for i in range(copies)]
    adapted = m - extra
    case = {"sets": sets, "sizes": sizes, "bytes_per_call": nbytes,
            "flops": 2 * adapted * (k * r + r * n),
            "desc": {"model": model, "K": k, "N": n, "M": m, "slots": s, "rank": r,
                     "tokens_per_slot": sizes, "no_adapter": extra, "copies": copies}}
    case["token_order"] = np.random.default_rng(seed).permutation(m)  # the wrapper's input
    ctx.cases[key] = case
    return case


def _token_inputs(case: dict, x, a, b):
    """The sorted case as the runtime wrapper receives it: tokens shuffled, a slot each."""
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.cases import lora_row_slots
    order = case["token_order"]
    slots = lora_row_slots(case["sizes"], x.shape[0])[order]
    return x[jnp.asarray(order)], a, b, jnp.asarray(slots, jnp.int32), np.asarray(order)


def check_lora(ctx: Ctx, model: str, k: int, n: int, m: int, s: int, r: int) -> dict:
    """The kernel, and the runtime wrapper on the shuffled tokens, against the reference within
    the kernel tests' elementwise bound (LORA_TOLERANCE)."""
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.runtime.lora import kernel_lora_delta
    from pallas_kernels.cases import LORA_TOLERANCE, lora_error_bound, lora_row_slots
    from pallas_kernels.lora import lora_sgmv, lora_sgmv_reference
    c = lora_inputs(ctx, model, k, n, m, s, r)
    x, a, b, gs = c["sets"][0]
    ref = np.asarray(lora_sgmv_reference(x, a, b, gs), np.float64)
    out = np.asarray(lora_sgmv(x, a, b, gs, interpret=ctx.prof.interpret), np.float64)
    xt, _, _, slots, order = _token_inputs(c, x, a, b)
    wrapped = np.asarray(kernel_lora_delta(ctx.prof.interpret)(xt, a, b, slots), np.float64)
    bound = lora_error_bound(x, a, b, lora_row_slots(c["sizes"], m), ref, jnp.bfloat16)
    errs = {name: np.abs(got - want) for name, got, want in
            (("kernel", out, ref), ("wrapper", wrapped, ref[order]))}
    finite = bool(np.isfinite(out).all() and np.isfinite(wrapped).all())
    ok = finite and bool((errs["kernel"] <= bound).all()
                         and (errs["wrapper"] <= bound[order]).all())
    scale = float(np.max(np.abs(ref)))
    return {**c["desc"], "dtype": "bfloat16", "finite": finite,
            "max_abs_err": float(max(e.max() for e in errs.values())),
            "max_rel_err": float(max(e.max() for e in errs.values()) / scale),
            "rel_err_note": "normalised by max|reference|",
            "tolerance": LORA_TOLERANCE["bfloat16"], "within_tol": ok}


def time_lora(ctx: Ctx, model: str, k: int, n: int, m: int, s: int, r: int) -> dict:
    """The kernel on sorted rows beside the same tiling in XLA (the runtime's fallback), the
    runtime wrapper (sort, kernel, scatter back) and a per-token gather in XLA on shuffled
    tokens; bytes and flops are the kernel's useful ones (bytes_per_call, 2 x adapted rows x
    (K R + R N))."""
    import jax
    from jaxserve.runtime.lora import kernel_lora_delta, xla_lora_delta_reference
    from pallas_kernels.lora import lora_sgmv, lora_sgmv_xla
    c = lora_inputs(ctx, model, k, n, m, s, r)
    p = ctx.prof
    tokens = [_token_inputs(c, *st[:3])[:4] for st in c["sets"]]

    def kernel(*args):
        return lora_sgmv(*args, interpret=p.interpret)

    impls = {"kernel": (kernel, c["sets"]), "xla_tiled": (lora_sgmv_xla, c["sets"]),
             "wrapper": (jax.jit(kernel_lora_delta(p.interpret)), tokens),
             "per_token_xla": (jax.jit(xla_lora_delta_reference), tokens)}
    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"], "flops_per_call": c["flops"]}
    for name, (fn, sets) in impls.items():
        t = time_calls(fn, sets, p.iters, p.reps)
        row[name] = {**rates(ctx, t["median_s"], c["bytes_per_call"], c["flops"]),
                     "first_call_s": t["first_call_s"]}
    for name in ("xla_tiled", "per_token_xla"):
        row[f"kernel_over_{name}"] = row["kernel"]["median_s"] / row[name]["median_s"]
    return row
