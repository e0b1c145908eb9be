"""Times the MoE MLP's ragged_dot grouped matmul against dense references, on this machine.

    .venv/bin/python scripts/bench_moe_cpu.py [--repeats 5]

Three ways to compute the same top-k expert FFN, alternated in one process (the CPU is shared
and noisy: compare the ratios in a row, not across runs):
- grouped: models/moe.py (sort by expert, three `jax.lax.ragged_dot`s);
- all-experts: every expert on every token, outputs weighted by the (mostly zero) routing
  weights: the dense compute the grouped matmul is meant to avoid;
- gathered: each (token, slot) pair multiplies the weight matrices of its expert, gathered.
Prints a markdown table with the load average.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

if __name__ == "__main__":
    _path = pathlib.Path(__file__).resolve().parent.parent
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models.moe import moe_ffn, route  # noqa: E402


def all_experts(x, router, gate, up, down, k, renormalize):
    _, weights, experts = route(x, router, k, renormalize)
    dense = jnp.zeros((x.shape[0], gate.shape[0]), x.dtype)  # [N, E]
    dense = dense.at[jnp.arange(x.shape[0])[:, None], experts].set(weights.astype(x.dtype))
    h = jax.nn.silu(jnp.einsum("ND,EDF->ENF", x, gate)) * jnp.einsum("ND,EDF->ENF", x, up)
    return jnp.einsum("ENF,EFD,NE->ND", h, down, dense), experts


def gathered(x, router, gate, up, down, k, renormalize):
    _, weights, experts = route(x, router, k, renormalize)
    g, u, dn = gate[experts], up[experts], down[experts]  # [N, k, D, F], [N, k, F, D]
    h = jax.nn.silu(jnp.einsum("ND,NKDF->NKF", x, g)) * jnp.einsum("ND,NKDF->NKF", x, u)
    y = jnp.einsum("NKF,NKFD->NKD", h, dn)
    return jnp.sum(y * weights.astype(x.dtype)[..., None], axis=1), experts


WAYS = {"grouped": moe_ffn, "all-experts": all_experts, "gathered": gathered}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    # (tokens, experts, top-k, d_model, expert ffn): decode-sized and prefill-sized batches.
    for n, e, k, d, f in [(8, 8, 2, 256, 512), (64, 8, 2, 256, 512), (512, 8, 2, 256, 512),
                          (64, 32, 4, 256, 256), (512, 32, 4, 256, 256)]:
        rng = np.random.default_rng(0)
        arrays = [jnp.asarray(rng.standard_normal(s), jnp.float32) / np.sqrt(s[-2])
                  for s in [(n, d + 1), (d, e), (e, d, f), (e, d, f), (e, f, d)]]
        arrays[0] = arrays[0][:, :d] * np.sqrt(d + 1)
        fns = {w: jax.jit(fn, static_argnames=("k", "renormalize")) for w, fn in WAYS.items()}
        ref = None
        for name, fn in fns.items():  # compile, and check the ways agree
            out = np.asarray(fn(*arrays, k=k, renormalize=True)[0])
            ref = out if ref is None else ref
            assert np.allclose(out, ref, atol=1e-4), name
        times = {w: [] for w in fns}
        for _ in range(args.repeats):  # alternate the ways so load swings hit them all
            for name, fn in fns.items():
                t = time.perf_counter()
                jax.block_until_ready(fn(*arrays, k=k, renormalize=True))
                times[name].append(time.perf_counter() - t)
        med = {w: float(np.median(v)) * 1e3 for w, v in times.items()}
        rows.append((n, e, k, d, f, med))
    print(f"load average {os.getloadavg()}; jax {jax.__version__} on {jax.default_backend()}; "
          f"median of {args.repeats}, ms")
    print("| tokens | E | k | D | F | grouped (ragged_dot) | all-experts | gathered |")
    print("|---|---|---|---|---|---|---|---|")
    for n, e, k, d, f, med in rows:
        print(f"| {n} | {e} | {k} | {d} | {f} | {med['grouped']:.2f} | "
              f"{med['all-experts']:.2f} ({med['all-experts'] / med['grouped']:.2f}x) | "
              f"{med['gathered']:.2f} ({med['gathered'] / med['grouped']:.2f}x) |")


if __name__ == "__main__":
    main()
