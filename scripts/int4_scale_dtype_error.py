"""What bfloat16 scales and offsets (the GPU format, jaxserve/quantization/gpu_format.py) add
to int4 RTN's own error: relative output error of x @ w_int4 against x @ w, with float32 and
with bfloat16 scales/offsets, and of the two quantized products against each other.

  .venv/bin/python scripts/int4_scale_dtype_error.py [--weights FILE.safetensors]

Weights: N(0, 1) [4096, 4096] at g = 128 and [576, 1536] at g = 64, and, given a converted
SmolLM2 (`params/layers/.../kernel` [L, K, N] float32), its layer-0 and layer-15 linears.
Activations: N(0, 1) rows, and the same shifted by a mean of 1 per channel (a stand-in for
activations whose group sums do not cancel, where the offsets' rounding shows most).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.core import QuantSpec
from jaxserve.quantization.rtn import rtn_weight
from jaxserve.quantization.core import dequantize_weight
from jaxserve.quantization.gpu_format import gpu_int4


def errors(w: np.ndarray, g: int, symmetric: bool, x: np.ndarray) -> tuple[float, ...]:
    """Relative output errors: int4 f32 scales vs float; GPU format (bf16 scales) vs float;
    GPU format vs f32 scales; bf16 scales and bf16 offsets vs f32 scales (not used)."""
    q = rtn_weight(jnp.asarray(w), QuantSpec(bits=4, group_size=g, symmetric=symmetric))
    gpu = gpu_int4(q)
    both = dataclasses.replace(gpu, offsets=None if q.offsets is None
                               else jnp.asarray(q.offsets, jnp.bfloat16))
    w32, w16, wb = (np.asarray(dequantize_weight(v), np.float64) for v in (q, gpu, both))
    y = x @ w.astype(np.float64)
    y32, y16, yb = x @ w32, x @ w16, x @ wb
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    return rel(y32, y), rel(y16, y), rel(y16, y32), rel(yb, y32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", help="a converted model's weights.safetensors")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = [("N(0,1) 4096x4096", rng.standard_normal((4096, 4096)).astype(np.float32), 128),
             ("N(0,1) 576x1536", rng.standard_normal((576, 1536)).astype(np.float32), 64)]
    if a.weights:
        from safetensors.numpy import load_file
        d = load_file(a.weights)
        for name in ("attn/q_proj", "mlp/up_proj", "mlp/down_proj"):
            for layer in (0, 15):
                w = d[f"params/layers/{name}/kernel"][layer]
                cases.append((f"SmolLM2 L{layer} {name}", w, 128 if w.shape[0] % 128 == 0
                              else 64))
    print("| weights | g | sym | x | int4 (f32 scales) vs float | GPU format vs float | "
          "GPU format vs f32 scales | bf16 offsets too vs f32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, w, g in cases:
        k = w.shape[0]
        x0 = rng.standard_normal((16, k))
        for xname, x in (("N(0,1)", x0), ("N(1,1)", x0 + 1.0)):
            for sym in (False, True):
                e32, e16, d, db = errors(w, g, sym, x)
                off = "-" if sym else f"{db:.5f}"
                print(f"| {name} | {g} | {'y' if sym else 'n'} | {xname} | {e32:.4f} | "
                      f"{e16:.4f} | {d:.5f} | {off} |", flush=True)


if __name__ == "__main__":
    main()
