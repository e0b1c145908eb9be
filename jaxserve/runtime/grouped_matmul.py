"""The MoE experts' grouped matmul backend: which implementation runs `models/moe.py`'s
`grouped_matmul(a, w, group_sizes, parallel)` inside the jitted step.

The kind is the linear backend's (`EngineConfig.linear_backend`, resolved): the experts are
the MoE model's linears.
- `pallas` / `pallas-interpret`: the Pallas kernel of the step's GPU kernels
  (`StepProgram.gpu_kernels`): on "mosaic" (Hopper) the Mosaic GPU kernel
  (pallas_kernels/grouped_matmul_mgpu.py) where it takes the projection (bf16/f16
  activations, K and N multiples of 64), else the Triton kernel (pallas_kernels/
  grouped_matmul.py); through JAX's GPU interpreter or the Pallas interpreter for
  `pallas-interpret` (tests). A projection the Triton kernel cannot tile either (K or N not a
  multiple of 16) runs the tiled XLA path.
- `xla`: the tiled XLA path (`grouped_matmul_tiled`), its tile picked per shape by
  `cpu_tile_rows` (a cost model fitted on XLA:CPU only, docs/moe.md). ragged_dot was never
  measurably faster there, so it is not chosen.
- `cpu` (the native CPU linears, jaxserve/native): the tiled XLA path as for `xla`; the native
  kernel has no grouped form, and the experts' int8 codes are not repacked for it.
- `ragged`: always `jax.lax.ragged_dot` (models/moe.py's default; the oracle in tests).
Under tensor parallelism the kernel runs per shard (`TensorParallel.grouped_matmul`); the XLA
paths are partitioned by XLA from the weights' shardings.
"""

from __future__ import annotations

import logging

from models.moe import int8_expert_arrays, ragged_gmm
from models.quantized import is_quantized
from pallas_kernels.grouped_matmul import (grouped_matmul, grouped_matmul_tiled,
                                           kernel_unsupported, num_items)
from pallas_kernels.grouped_matmul_mgpu import grouped_matmul_mgpu
from pallas_kernels.grouped_matmul_mgpu import unsupported as mosaic_unsupported
from pallas_kernels.mosaic_interpret import mosaic_interpret

log = logging.getLogger("jaxserve")

KINDS = ("xla", "cpu", "pallas", "pallas-interpret", "ragged")


def _arrays(w):
    """(weights, scales or None) as the pallas_kernels functions take them."""
    return int8_expert_arrays(w) if is_quantized(w) else (w, None)


# Cost of one work item's [K, N] weights (gathered, then read by the dot) in rows of
# multiply-adds: fitted to scripts/bench_moe_cpu.py on XLA:CPU (docs/moe.md); 128 puts every
# measured shape's best tile within noise of the chosen one.
ITEM_COST_ROWS = 128
_TILE_ROWS = tuple(1 << i for i in range(8))  # 1 .. 128, the measured range


def cpu_tile_rows(m: int, num_experts: int) -> int:
    """The tiled XLA path's tile for M rows over E experts: the tm minimising the modelled
    cost `num_items * (ITEM_COST_ROWS + tm)` (per-item weight traffic plus the rows computed,
    padding included). Decode-sized M gets 1 (each row its own item: M gathered expert
    matrices, fewer than E), prefill-sized M 32..128."""
    return min(_TILE_ROWS, key=lambda tm: (num_items(m, num_experts, tm) * (ITEM_COST_ROWS + tm),
                                           tm))


def tiled_gmm(tm: int | None = None):
    """The tiled XLA path; tm None picks `cpu_tile_rows` for each call's shape."""
    def gmm(a, w, group_sizes, parallel=None):
        del parallel
        rows = tm or cpu_tile_rows(max(a.shape[0], 1), group_sizes.shape[0])
        wq, scales = _arrays(w)
        return grouped_matmul_tiled(a, wq, group_sizes, scales, tm=rows)
    return gmm


def kernel_gmm(interpret: bool = False, gpu_kernels: str = "triton"):
    """The Pallas kernel: Mosaic GPU's where `gpu_kernels` is "mosaic" and it takes the
    shape and dtypes (static, at trace time), else Triton's, else the tiled XLA path."""
    fallback = tiled_gmm()

    def gmm(a, w, group_sizes, parallel=None):
        wq, scales = _arrays(w)
        k, n = a.shape[1], (wq.shape[1] if scales is not None else wq.shape[2])
        if gpu_kernels == "mosaic" and mosaic_unsupported(k, n, a.dtype, wq.dtype) is None:
            return grouped_matmul_mgpu(a, wq, group_sizes, scales,
                                       interpret=mosaic_interpret(interpret))
        why = kernel_unsupported(k, n)
        if why:
            log.info("grouped matmul kernel cannot run [%d] x [%d] (%s): tiled XLA path", k, n,
                     why)
            return fallback(a, w, group_sizes, parallel)
        return grouped_matmul(a, wq, group_sizes, scales, interpret=interpret)
    return gmm


def grouped_matmul_backend(kind: str, gpu_kernels: str = "triton"):
    """The grouped matmul for a resolved backend kind and, for the kernel, the step's GPU
    kernels ("mosaic" or "triton"; see the module docstring)."""
    if gpu_kernels not in ("mosaic", "triton"):
        raise ValueError(f"gpu_kernels must be 'mosaic' or 'triton', got {gpu_kernels!r}")
    if kind not in KINDS:
        raise ValueError(f"grouped matmul backend must be one of {KINDS}, got {kind!r}")
    if kind == "ragged":
        return ragged_gmm
    if kind in ("pallas", "pallas-interpret"):
        return kernel_gmm(interpret=kind == "pallas-interpret", gpu_kernels=gpu_kernels)
    return tiled_gmm()
