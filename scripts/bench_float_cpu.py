"""Micro-benchmark: XLA's dot against the native float matmul at few rows, SmolLM2 shapes.

    .venv/bin/python scripts/bench_float_cpu.py [--rows 1 4 9 16 32] [--repeats 20]

Prints one line per (shape, weight dtype, rows): median microseconds per call of XLA's dot
(models/llama.py's dense_linear; for the head the tied einsum x @ E^T) and of
cpu_float_matmul.cc, and the weight bytes per call over the native time (GB/s).
See docs/performance.md, "Where a step's time goes (CPU)".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import jax
import jax.numpy as jnp

from jaxserve.native.float_matmul import float_matmul_cpu
from models.llama import dense_linear, tied_head

# (K, N, transposed): the q/gate/up and down projections as [K, N]; the tied head as [V, D].
SHAPES = ((576, 1536, False), (1536, 576, False), (576, 49152, True))


def timeit(fn, *args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=(1, 4, 9, 16, 32))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtypes", nargs="+", default=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}; load average {os.getloadavg()}")
    rng = np.random.default_rng(0)
    for k, n, t in SHAPES:
        for dt in args.dtypes:
            shape = (n, k) if t else (k, n)
            w = jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.05, dt)
            xla = jax.jit(tied_head if t else dense_linear)
            nat = jax.jit(lambda x, w, t=t: float_matmul_cpu(x, w, t))
            for m in args.rows:
                x = jnp.asarray(rng.standard_normal((m, k)), dt)  # activations in the model dtype
                a = timeit(xla, x, w, repeats=args.repeats)
                b = timeit(nat, x, w, repeats=args.repeats)
                print(f"{'head ' if t else ''}[{shape[0]},{shape[1]}] {dt:8s} M={m:3d}  "
                      f"xla {a * 1e6:8.0f} us  native {b * 1e6:8.0f} us  "
                      f"({w.nbytes / b / 1e9:5.1f} GB/s)  x{a / b:4.2f}", flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
