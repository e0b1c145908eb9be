"""Micro-benchmark: CPU matmul options for int4 / int8 weights on SmolLM2 decode shapes.

    .venv/bin/python scripts/bench_int4_cpu.py [--rows 1 16 64] [--repeats 20]

Prints one line per (shape, option): median microseconds per call and the weight bytes read per
call over that time (GB/s). Options: f32 dense; xla-deq (today's CPU W4A16: dequantize in the
step, then an f32 dot); xla-int4 (jnp.int4 codes in dot_general, int8 activations, int32 sums
per group); xla-unpack (nibbles unpacked to int8 in the step, then int8 dots per group);
xla-w8a8 (int8 per channel, XLA's int8 dot: today's W8A8); native (cpu_quant_matmul.cc, limbs
1 = W4A8, 2 = W4A16 fixed point; int8 g32 = GGUF Q8_0). See docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import jax
import jax.numpy as jnp

from jaxserve.native.quant_matmul import quant_matmul_cpu
from jaxserve.quantization.cpu_packed import pack_weight
from jaxserve.quantization.linear import quantize_activations
from models.quantized import Int4Weight, Int8Weight
from pallas_kernels.int4_matmul import int4_matmul_reference, quantize_int4

SHAPES = ((576, 1536), (1536, 576), (576, 49152))


def timeit(fn, *args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def xla_int4(x, codes, scales, g):
    """codes [N, K] jnp.int4 (u - 8); int8 activations per row; int32 dot per group."""
    xq, sx = quantize_activations(x)
    m, k = x.shape
    n = codes.shape[0]
    d = jax.lax.dot_general(xq.reshape(m, k // g, g), codes.reshape(n, k // g, g),
                            (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32)
    return jnp.einsum("Gmn,Gn->mn", d.astype(jnp.float32), scales) * sx  # d [G, M, N]


def xla_unpack(x, packed, scales, g):
    """packed [N, K/2] uint8 (per-group halves), unpacked to int8 in the step."""
    xq, sx = quantize_activations(x)
    m, k = x.shape
    n = packed.shape[0]
    q = packed.reshape(n, k // g, g // 2)
    c = (jnp.concatenate([q & 0xF, q >> 4], axis=-1).astype(jnp.int8) - 8)  # [N, G, g]
    d = jax.lax.dot_general(xq.reshape(m, k // g, g), c, (((2,), (2,)), ((1,), (1,))),
                            preferred_element_type=jnp.int32)
    return jnp.einsum("Gmn,Gn->mn", d.astype(jnp.float32), scales) * sx


def xla_w8a8(x, q8, s):
    xq, sx = quantize_activations(x)
    xq = jnp.pad(xq, ((0, 1), (0, 0))) if x.shape[0] == 1 else xq
    y = jax.lax.dot_general(xq, q8, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return y[:x.shape[0]].astype(jnp.float32) * sx * s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=(1, 16, 64))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--shapes", default="all", help="'all' or an index into the shape list")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}; load average {os.getloadavg()}")
    rng = np.random.default_rng(0)
    shapes = SHAPES if args.shapes == "all" else (SHAPES[int(args.shapes)],)
    for k, n in shapes:
        w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) * 0.05)
        options = {}
        options["f32 dense"] = (jax.jit(lambda x, w: x @ w), (w,), 4 * k * n)
        for g in (32, 128 if k % 128 == 0 else 64):
            packed, s, b = quantize_int4(w, group_size=g)
            w4 = Int4Weight(packed=packed, scales=s, offsets=b, group_size=g)
            nbytes = k * n // 2 + 8 * k * n // g
            if g > 32 or n < 49152:
                options[f"xla-deq g{g}"] = (
                    jax.jit(lambda x, p, s, b, g=g: int4_matmul_reference(x, p, s, b,
                                                                          group_size=g)),
                    (packed, s, b), nbytes)
            u = np.asarray(packed)
            u = np.concatenate([u.reshape(k // g, g // 2, n) & 15, u.reshape(k // g, g // 2, n)
                                >> 4], 1).reshape(k, n)
            codes4 = jnp.asarray((u.astype(np.int8) - 8).T).astype(jnp.int4)
            options[f"xla-int4 g{g}"] = (jax.jit(xla_int4, static_argnums=3),
                                         (codes4, s, g), nbytes)
            pk = jnp.asarray(np.asarray(packed).reshape(k // g, g // 2, n).transpose(2, 0, 1)
                             .reshape(n, k // 2))
            options[f"xla-unpack g{g}"] = (jax.jit(xla_unpack, static_argnums=3), (pk, s, g),
                                           nbytes)
            cw = pack_weight(w4)
            for limbs in (1, 2):
                options[f"native int4 g{g} limbs{limbs}"] = (
                    jax.jit(quant_matmul_cpu, static_argnums=2), (cw, limbs), nbytes)
        q8 = jnp.asarray(np.clip(np.round(np.asarray(w).T / 0.01), -127, 127).astype(np.int8))
        s1 = jnp.full((1, n), 0.01, jnp.float32)
        options["xla-w8a8 channel"] = (jax.jit(xla_w8a8), (q8, s1), k * n)
        w8 = Int8Weight(q8=q8, scales=jnp.full((k // 32, n), 0.01), group_size=32)
        for limbs in (1, 2):
            options[f"native int8 g32 limbs{limbs}"] = (
                jax.jit(quant_matmul_cpu, static_argnums=2), (pack_weight(w8), limbs),
                k * n + 4 * k * n // 32)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            for name, (fn, rest, nbytes) in options.items():
                sec = timeit(fn, x, *rest, repeats=args.repeats)
                print(f"[{m},{k}]x[{k},{n}] {name:24s} {sec * 1e6:9.1f} us "
                      f"{nbytes / sec / 1e9:6.1f} GB/s", flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
