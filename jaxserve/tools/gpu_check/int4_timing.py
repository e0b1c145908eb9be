"""The int4 matmul in section `kernel_timings`: the Pallas Triton kernel beside the Mosaic GPU
one and real XLA baselines on the same weights, all from the engine's format (packed codes,
per-group scales and offsets):

  mosaic_kernel     the Mosaic GPU kernel (pallas_kernels/int4_matmul_mgpu.py), where it takes
                    the shape: `kernel_over_mosaic_kernel` is Triton's time over Mosaic's
  xla_bf16_dequant  unpack and dequantize to bf16, then a default-precision bf16 dot: what
                    XLA does with the engine's int4 weights without the kernel
  xla_native_int4   the codes stored as `jnp.int4` [K, N] (XLA's own int4 type, half a byte
                    per weight in memory) with bf16 scales and offsets folded, the convert and
                    scaling left to XLA to fuse into its dot
  dense_bf16_xla    a bf16 [K, N] weight, the dense bound on the same shape

bytes_per_call is the kernel's weight bytes (packed + f32 scales + offsets); each baseline's
rate uses its own bytes."""

from __future__ import annotations

from jaxserve.tools.gpu_check.context import Ctx, rates, time_calls
from jaxserve.tools.gpu_check.kernel_inputs import int4_case


def bf16_dequant_matmul(group_size: int):
    """x [M, K] bf16, packed [K/2, N] u8, scales/offsets [K/g, N] -> [M, N] bf16."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.int4_matmul import unpack_int4

    @jax.jit
    def fn(x, packed, scales, offsets):
        u = unpack_int4(packed, group_size=group_size).astype(jnp.bfloat16)  # [K, N]
        k, n = u.shape
        w = (u.reshape(k // group_size, group_size, n) * scales.astype(jnp.bfloat16)[:, None]
             + offsets.astype(jnp.bfloat16)[:, None]).reshape(k, n)  # [K, N] bf16
        return jnp.dot(x, w)
    return fn


def native_int4_weights(packed, scales, offsets, group_size: int):
    """The engine's weights as jnp.int4 codes q = u - 8 [K, N] with bf16 scales s and offsets
    o + 8 s [K/g, N] (so that s q + o' = s u + o)."""
    import jax.numpy as jnp
    from pallas_kernels.int4_matmul import unpack_int4
    q = (unpack_int4(packed, group_size=group_size) - 8).astype(jnp.int4)  # [K, N]
    s = scales.astype(jnp.float32)
    return q, s.astype(jnp.bfloat16), (offsets.astype(jnp.float32) + 8 * s).astype(jnp.bfloat16)


def native_int4_matmul(group_size: int):
    """x [M, K] bf16, q [K, N] int4, s / o [K/g, N] bf16 -> [M, N] bf16."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fn(x, q, s, o):
        k, n = q.shape
        w = (q.astype(jnp.bfloat16).reshape(k // group_size, group_size, n) * s[:, None]
             + o[:, None]).reshape(k, n)  # [K, N] bf16, fused into the dot's operand by XLA
        return jnp.dot(x, w)
    return fn


def time_int4(ctx: Ctx, model: str, k: int, n: int, m: int) -> dict:
    from pallas_kernels import int4_matmul_mgpu as mgpu
    from pallas_kernels.int4_matmul import int4_matmul, pick_blocks
    from pallas_kernels.mosaic_interpret import mosaic_interpret
    c = int4_case(ctx, model, k, n, m)
    p, g, x = ctx.prof, c["group_size"], c["x"]
    sets = [(x, *w) for w in c["weights"]]
    native = [(x, *native_int4_weights(*w, g)) for w in c["weights"]]
    native_bytes = k * n // 2 + 2 * (k // g) * n * 2
    flops = 2 * m * k * n

    def kernel(*a):
        return int4_matmul(*a, group_size=g, interpret=p.interpret)

    def mosaic(*a):
        return mgpu.int4_matmul_mgpu(*a, group_size=g, interpret=mosaic_interpret(p.interpret))

    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"],
           "blocks_mnk_split": list(pick_blocks(m, k, n, g))}
    dense = [(x, w) for w in c["dense"]]
    why = mgpu.unsupported(m, k, n, g, x.dtype)
    if why is not None:
        row["mosaic_kernel_unsupported"] = why
    for name, fn, args, nbytes in (
            ("kernel", kernel, sets, c["bytes_per_call"]),
            *([("mosaic_kernel", mosaic, sets, c["bytes_per_call"])] if why is None else []),
            ("xla_bf16_dequant", bf16_dequant_matmul(g), sets, c["bytes_per_call"]),
            ("xla_native_int4", native_int4_matmul(g), native, native_bytes),
            ("dense_bf16_xla", _dense(), dense, 2 * k * n)):
        if name != "kernel" and ctx.over_budget():
            row.setdefault("skipped_baselines", []).append(name)
            continue
        t = time_calls(fn, args, p.iters, p.reps)
        row[name] = {**rates(ctx, t["median_s"], nbytes, flops),
                     "first_call_s": t["first_call_s"], "bytes_per_call": nbytes}
    for name in ("mosaic_kernel", "xla_bf16_dequant", "xla_native_int4", "dense_bf16_xla"):
        if name in row:
            row[f"kernel_over_{name}"] = row["kernel"]["median_s"] / row[name]["median_s"]
    return row


def _dense():
    import jax
    import jax.numpy as jnp
    return jax.jit(lambda a, w: jnp.dot(a, w))


def md_int4_row(row: dict, fmt) -> str:
    """A row of the timings table: XLA = the bf16 dequantize-then-matmul baseline."""
    k = row["kernel"]
    x = row.get("xla_bf16_dequant", {})
    extra = "; ".join(f"{label} {row[n]['median_s'] * 1e6:.1f} us "
                      f"({row[f'kernel_over_{n}']:.2f}x)"
                      for n, label in (("mosaic_kernel", "Mosaic GPU"),
                                       ("xla_native_int4", "jnp.int4"),
                                       ("dense_bf16_xla", "dense bf16")) if n in row)
    return (f"| int4_matmul | {row['model']} {row['K']}->{row['N']} M{row['M']} | "
            f"{row['bytes_per_call'] / 1e6:.2f} | {k['median_s'] * 1e6:.1f} | "
            f"{k['bytes_per_s'] / 1e12:.3f} | {k['vs_nominal_bw']:.2f} | "
            f"{fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
            f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | "
            f"{fmt(x.get('median_s', float('nan')) * 1e6, '.1f')} | "
            f"{fmt(row.get('kernel_over_xla_bf16_dequant'), '.2f')} | {extra}; "
            f"{k['flops_per_s'] / 1e12:.2f} TFLOP/s |")
