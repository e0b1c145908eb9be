"""The MoE experts' grouped matmul backend: which implementation runs `models/moe.py`'s
`grouped_matmul(a, w, group_sizes, parallel)` inside the jitted step.

The kind is the linear backend's (`EngineConfig.linear_backend`, resolved): the experts are
the MoE model's linears.
- `pallas` / `pallas-interpret`: the Triton kernel (pallas_kernels/grouped_matmul.py), or the
  same kernel through the Pallas interpreter (tests). A projection the kernel cannot tile
  (K or N not a multiple of 16) runs the tiled XLA path instead.
- `xla`: the tiled XLA path (`grouped_matmul_tiled`), or `jax.lax.ragged_dot` where
  `cpu_choice` says so; its tile and choice were measured on XLA:CPU only (docs/moe.md).
- `ragged`: always `jax.lax.ragged_dot` (models/moe.py's default; the oracle in tests).
Under tensor parallelism the kernel runs per shard (`TensorParallel.grouped_matmul`); the XLA
paths are partitioned by XLA from the weights' shardings.
"""

from __future__ import annotations

import logging

from models.moe import int8_expert_arrays, ragged_gmm
from models.quantized import is_quantized
from pallas_kernels.grouped_matmul import (grouped_matmul, grouped_matmul_tiled,
                                           kernel_unsupported)

log = logging.getLogger("jaxserve")

KINDS = ("xla", "pallas", "pallas-interpret", "ragged")


def _arrays(w):
    """(weights, scales or None) as the pallas_kernels functions take them."""
    return int8_expert_arrays(w) if is_quantized(w) else (w, None)


def cpu_choice(m: int, num_experts: int) -> tuple[str, int]:
    """("tiled", tm) or ("ragged", 0) for M rows over E experts on XLA:CPU (docs/moe.md)."""
    if m <= num_experts:
        return "tiled", 1
    return "tiled", 32


def tiled_gmm(tm: int | None = None):
    """The tiled XLA path; tm None picks `cpu_choice`'s tile (or ragged_dot where it chooses)."""
    def gmm(a, w, group_sizes, parallel=None):
        del parallel
        rows = tm
        if rows is None:
            way, rows = cpu_choice(a.shape[0], group_sizes.shape[0])
            if way == "ragged":
                return ragged_gmm(a, w, group_sizes)
        wq, scales = _arrays(w)
        return grouped_matmul_tiled(a, wq, group_sizes, scales, tm=rows)
    return gmm


def kernel_gmm(interpret: bool = False):
    """The Pallas kernel (falls back to the tiled XLA path for shapes it cannot tile)."""
    fallback = tiled_gmm()

    def gmm(a, w, group_sizes, parallel=None):
        wq, scales = _arrays(w)
        k, n = a.shape[1], (wq.shape[1] if scales is not None else wq.shape[2])
        why = kernel_unsupported(k, n)
        if why:
            log.info("grouped matmul kernel cannot run [%d] x [%d] (%s): tiled XLA path", k, n,
                     why)
            return fallback(a, w, group_sizes, parallel)
        return grouped_matmul(a, wq, group_sizes, scales, interpret=interpret)
    return gmm


def grouped_matmul_backend(kind: str):
    """The grouped matmul for a resolved backend kind (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"grouped matmul backend must be one of {KINDS}, got {kind!r}")
    if kind == "ragged":
        return ragged_gmm
    if kind in ("pallas", "pallas-interpret"):
        return kernel_gmm(interpret=kind == "pallas-interpret")
    return tiled_gmm()
