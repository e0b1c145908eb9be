"""The grouped matmul (the MoE experts' projection) in section `kernel_timings`: the Pallas
Triton kernel (pallas_kernels/grouped_matmul.py) beside the Mosaic GPU one
(pallas_kernels/grouped_matmul_mgpu.py), the engine's `pallas` grouped matmul backend's two
kernels (jaxserve/runtime/grouped_matmul.py picks one), and XLA's `jax.lax.ragged_dot`, on rows
routed as the engine routes them (random top-k choices sorted by models/moe.py's
`sort_by_expert`):

  kernel               the Triton kernel, bf16 weights `[E, K, N]`
  mosaic_kernel        the Mosaic GPU kernel, where `unsupported` takes the shape:
                       `kernel_over_mosaic_kernel` is Triton's time over Mosaic's
  xla_ragged_dot       models/moe.py's `ragged_gmm` (`jax.lax.ragged_dot`: the engine's `ragged`
                       backend), bf16 weights
  kernel_int8,         both kernels on int8 codes `[E, N, K]` with f32 scales `[E, N]` (w8a16's
  mosaic_kernel_int8   experts)

A case is (model, experts E, K, N, tokens, top_k), bf16 activations: M = tokens * top_k rows.
bytes_per_call is the Mosaic kernel's `cost()` at its default tile (weights of min(E, M)
experts, x padded and its metadata, the item outputs written and gathered), the bf16 one for
the bf16 rows and the int8 one for the int8 rows; every implementation's rate uses it, so the
rates compare times (the Triton kernel's own tiles move a little more or less)."""

from __future__ import annotations

import math
import zlib

from jaxserve.tools.gpu_check.context import Ctx, rates, time_calls
from jaxserve.tools.gpu_check.profiles import L2_BYTES


def gmm_inputs(ctx: Ctx, model: str, e: int, k: int, n: int, tokens: int, top_k: int) -> dict:
    """Rows of `tokens` random tokens routed to top_k distinct experts each, sorted by expert,
    and the experts' weights (bf16, and int8 codes with scales) in as many copies as make the
    timed reads exceed 2x L2."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from models.moe import sort_by_expert
    from pallas_kernels import grouped_matmul as triton
    from pallas_kernels import grouped_matmul_mgpu as mgpu
    key = ("gmm", model, e, k, n, tokens, top_k)
    if key in ctx.cases:
        return ctx.cases[key]
    rng = jax.random.split(jax.random.key(zlib.crc32(repr(key).encode())), 4)
    # top_k distinct experts per token: the first top_k of a random permutation of E.
    experts = jnp.argsort(jax.random.uniform(rng[0], (tokens, e)), axis=1)[:, :top_k]  # [T, k]
    order, group_sizes = sort_by_expert(experts.astype(jnp.int32), e)  # [T*k], [E]
    h = jax.random.normal(rng[1], (tokens, k), jnp.bfloat16)  # [T, K]
    x = h[order // top_k]  # [M, K], rows grouped by expert
    m = x.shape[0]
    bf16, int8 = mgpu.cost(m, e, k, n), mgpu.cost(m, e, k, n, int8=True)
    # Copies from the int8 call's bytes (the fewer), so the bf16 calls' reads exceed 2x L2 too.
    copies = int(min(ctx.prof.max_copies, max(1, math.ceil(2 * L2_BYTES / int8["bytes"]))))
    keys = jax.random.split(rng[2], copies)
    w = [(jax.random.normal(keys[i], (e, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
         for i in range(copies)]  # [E, K, N] each
    # Codes times scales of about 2e-4: weights of the bf16 ones' magnitude.
    keys = jax.random.split(rng[3], 2 * copies)
    codes = [(jax.random.randint(keys[2 * i], (e, n, k), -127, 128, jnp.int8),  # [E, N, K]
              jax.random.uniform(keys[2 * i + 1], (e, n), jnp.float32, 1e-4, 3e-4))  # [E, N]
             for i in range(copies)]
    sizes = np.asarray(group_sizes)
    case = {"x": x, "group_sizes": group_sizes, "weights": w, "codes": codes,
            "bytes_per_call": bf16["bytes"], "bytes_per_call_int8": int8["bytes"],
            "flops": bf16["flops"],
            "desc": {"model": model, "E": e, "K": k, "N": n, "tokens": tokens, "top_k": top_k,
                     "M": m, "experts_reached": int((sizes > 0).sum()),
                     "max_group_rows": int(sizes.max()), "tm_mosaic": mgpu.pick_tm(m, e),
                     "tm_triton": triton.pick_tm(m, e), "copies": copies}}
    ctx.cases[key] = case
    return case


def time_gmm(ctx: Ctx, model: str, e: int, k: int, n: int, tokens: int, top_k: int) -> dict:
    import jax
    import jax.numpy as jnp
    from models.moe import ragged_gmm
    from pallas_kernels import grouped_matmul_mgpu as mgpu
    from pallas_kernels.grouped_matmul import grouped_matmul
    from pallas_kernels.mosaic_interpret import mosaic_interpret
    c = gmm_inputs(ctx, model, e, k, n, tokens, top_k)
    p, x, gs = ctx.prof, c["x"], c["group_sizes"]
    sets = [(x, w, gs) for w in c["weights"]]
    int8_sets = [(x, q, gs, s) for q, s in c["codes"]]

    def kernel(*a):
        return grouped_matmul(*a, interpret=p.interpret)

    # One warpgroup a program: the GPU interpreter cannot stall on a small XLA:CPU pool
    # (pallas_kernels/mosaic_interpret.py), so no interpret_stall check.
    def mosaic(*a):
        return mgpu.grouped_matmul_mgpu(*a, interpret=mosaic_interpret(p.interpret))

    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"],
           "bytes_per_call_int8": c["bytes_per_call_int8"], "flops_per_call": c["flops"]}
    impls = [("kernel", kernel, sets), ("mosaic_kernel", mosaic, sets),
             ("xla_ragged_dot", jax.jit(ragged_gmm), sets),
             ("kernel_int8", kernel, int8_sets), ("mosaic_kernel_int8", mosaic, int8_sets)]
    for name, w_dtype in (("mosaic_kernel", None), ("mosaic_kernel_int8", jnp.int8)):
        why = mgpu.unsupported(k, n, x.dtype, w_dtype)
        if why is not None:
            row[f"{name}_unsupported"] = why
            impls = [i for i in impls if i[0] != name]
    for name, fn, args in impls:
        if name != "kernel" and ctx.over_budget():
            row.setdefault("skipped_baselines", []).append(name)
            continue
        # Interpreted, a Mosaic call's time means nothing: one sample exercises the row.
        once = name.startswith("mosaic_kernel") and p.interpret
        t = time_calls(fn, args, *((1, 1) if once else (p.iters, p.reps)))
        nbytes = c["bytes_per_call_int8" if name.endswith("int8") else "bytes_per_call"]
        row[name] = {**rates(ctx, t["median_s"], nbytes, c["flops"]),
                     "first_call_s": t["first_call_s"], "bytes_per_call": nbytes}
    for a, b in (("kernel", "mosaic_kernel"), ("kernel", "xla_ragged_dot"),
                 ("kernel_int8", "mosaic_kernel_int8")):
        if a in row and b in row:
            row[f"{a}_over_{b}"] = row[a]["median_s"] / row[b]["median_s"]
    return row


def gmm_case_name(row: dict) -> str:
    return (f"{row['model']} E{row['E']} {row['K']}->{row['N']} T{row['tokens']} "
            f"top{row['top_k']} (M{row['M']}, {row['experts_reached']} experts)")


def md_gmm_row(row: dict, fmt) -> str:
    """A row of the timings table: XLA = ragged_dot (bf16)."""
    if "error" in row:
        return f"| grouped_matmul | {row['case']} | ERROR: {row['error'][:120]} ||||||||"
    k = row["kernel"]
    x = row.get("xla_ragged_dot", {})
    us = {n: f"{row[n]['median_s'] * 1e6:.1f} us" for n in
          ("mosaic_kernel", "kernel_int8", "mosaic_kernel_int8") if n in row}
    extra = []
    if "mosaic_kernel" in us:
        extra.append(f"Mosaic GPU {us['mosaic_kernel']} "
                     f"({row['kernel_over_mosaic_kernel']:.2f}x)")
    if "kernel_int8" in us:
        extra.append(f"int8: Triton {us['kernel_int8']}"
                     + (f", Mosaic GPU {us['mosaic_kernel_int8']} "
                        f"({row['kernel_int8_over_mosaic_kernel_int8']:.2f}x)"
                        if "mosaic_kernel_int8" in us else ""))
    extra.append(f"{k['flops_per_s'] / 1e12:.2f} TFLOP/s")
    return (f"| grouped_matmul | {gmm_case_name(row)} | {row['bytes_per_call'] / 1e6:.2f} | "
            f"{k['median_s'] * 1e6:.1f} | {k['bytes_per_s'] / 1e12:.3f} | "
            f"{k['vs_nominal_bw']:.2f} | {fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
            f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | "
            f"{fmt(x.get('median_s', float('nan')) * 1e6, '.1f')} | "
            f"{fmt(row.get('kernel_over_xla_ragged_dot'), '.2f')} | {'; '.join(extra)} |")
