"""One layer of the native CPU ragged paged attention at decode, per KV-cache dtype.

SmolLM2's attention shapes (9 query heads over 3 KV heads, head_dim 64, blocks of 16), R decode
rows of C context tokens each; prints the median of 60 timed calls per cache dtype and the load
average (figures go in docs/, taken on a quiet machine).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_kv_attention.py [--rows 1 16] [--context 1024]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.native.attention import ragged_paged_attention_cpu
from jaxserve.runtime import kv_quant

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def caches(rng, num_blocks: int) -> dict:
    """{dtype: (k, v, k_scale, v_scale)} of one layer `[1, NB, BS, K, Dh]` (scales None for
    float caches)."""
    shape = (1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    (kc, ks), (vc, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
    return {"float32": (k, v, None, None),
            "bfloat16": (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None),
            "int8": (kc, vc, ks, vs)}


def median_us(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    pages = -(-args.context // BLOCK)
    print(f"load average {os.getloadavg()[0]:.2f}, jax {jax.__version__}")
    for rows in args.rows:
        table = jnp.asarray(1 + np.arange(rows * pages).reshape(rows, pages), jnp.int32)
        starts = jnp.arange(rows + 1, dtype=jnp.int32)  # one query per row
        lens = jnp.full((rows,), args.context, jnp.int32)
        q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM)), jnp.float32)
        for dtype, (k, v, ks, vs) in caches(rng, rows * pages + 1).items():
            fn = jax.jit(lambda q, k, v, ks, vs: ragged_paged_attention_cpu(
                q, k, v, 0, table, starts, lens, k_scale=ks, v_scale=vs))
            us = median_us(fn, (q, k, v, ks, vs), args.repeats)
            print(f"rows {rows:3d} context {args.context}: {dtype:9s} {us:8.0f} us")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
