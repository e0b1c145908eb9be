"""Times the MoE MLP's grouped matmul paths against each other on this machine's CPU.

    .venv/bin/python scripts/bench_moe_cpu.py [--repeats 3] [--tm 1 8 32] [--shapes small]

The whole MoE MLP (models/moe.py `moe_ffn`: routing, sort, three grouped matmuls, unsort),
float32, with each way of running the grouped matmul, alternated in one process (the CPU is
shared and noisy: compare the ratios in a row, not across runs):
- ragged: `jax.lax.ragged_dot` (XLA:CPU makes it a masked product over every expert);
- tiled tm=T: the megablox tiling in plain XLA (pallas_kernels/grouped_matmul.py
  `grouped_matmul_tiled`), T rows per tile;
- auto: the tiled path at the tile the `xla` backend picks for the shape
  (jaxserve/runtime/grouped_matmul.py `cpu_tile_rows`).
Every way is checked against ragged first. Prints a markdown table with the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.grouped_matmul import cpu_tile_rows, tiled_gmm
from models.moe import moe_ffn, ragged_gmm
from pallas_kernels.grouped_matmul import num_items

# A tiled way whose gathered weights ([items, D, F] float32) pass this is not run: at tm = 1
# and prefill sizes they take gigabytes (the machine is shared).
MAX_GATHER_BYTES = 512 << 20

# (label, experts, top-k, d_model, expert ffn, token counts): Mixtral-style routing at SmolLM2
# widths, and Qwen3-30B-A3B's routing (128 experts, top-8) at a quarter of its widths.
FAMILIES = {
    "smollm-ish": (8, 2, 576, 1536, (1, 8, 32, 256, 1024)),
    "qwen3moe-ish": (128, 8, 512, 192, (1, 8, 64, 256)),
}
SMALL = {"tiny": (8, 2, 64, 128, (1, 8, 256))}  # a smoke run (tests/scripts/test_bench_scripts.py)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tm", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--shapes", choices=("full", "small"), default="full")
    args = ap.parse_args(argv)
    ways = {"ragged": ragged_gmm, "auto": tiled_gmm()}
    ways.update({f"tm={t}": tiled_gmm(t) for t in args.tm})
    rows = []
    for label, (e, k, d, f, tokens) in (FAMILIES if args.shapes == "full" else SMALL).items():
        rng = np.random.default_rng(0)
        weights = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.float32)
                   for s in [(d, e), (e, d, f), (e, d, f), (e, f, d)]]
        for n in tokens:
            x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
            fns = {w: jax.jit(lambda *a, g=g: moe_ffn(*a, k, True, g)[0])
                   for w, g in ways.items()
                   if not w.startswith("tm=")
                   or num_items(n * k, e, int(w[3:])) * d * f * 4 <= MAX_GATHER_BYTES}
            ref = np.asarray(fns["ragged"](x, *weights))
            for name, fn in fns.items():  # compile, and check the ways agree
                np.testing.assert_allclose(np.asarray(fn(x, *weights)), ref, atol=1e-4,
                                           err_msg=name)
            times = {w: [] for w in fns}
            for _ in range(args.repeats):  # alternate the ways so load swings hit them all
                for name, fn in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(fn(x, *weights))
                    times[name].append(time.perf_counter() - t)
            med = {w: float(np.median(v)) * 1e3 for w, v in times.items()}
            rows.append((label, n * k, e, k, d, f, med, cpu_tile_rows(n * k, e)))
    print(f"load average {os.getloadavg()}; jax {jax.__version__} on {jax.default_backend()}; "
          f"median of {args.repeats}, ms (ratio: time / ragged's)")
    names = [w for w in ways if w != "ragged"]
    print("| shapes | M | E | k | D | F | ragged ms | " + " | ".join(names) + " |")
    print("|---" * (7 + len(names)) + "|")
    for label, m, e, k, d, f, med, tm in rows:
        cells = [f"{med[w]:.2f} ({med[w] / med['ragged']:.2f}x)" if w in med else "-"
                 for w in names]
        cells[0] += f" tm={tm}"
        print(f"| {label} | {m} | {e} | {k} | {d} | {f} | {med['ragged']:.2f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
