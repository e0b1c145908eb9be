"""The `interpret` argument of the Mosaic GPU kernels from the engine's interpret flag."""

from __future__ import annotations

import os

from jax.experimental.pallas import mosaic_gpu as plgpu


def mosaic_interpret(interpret: bool, detect_races: bool = False):
    """False on a GPU; JAX's GPU interpret mode (simulated threads, shared memory, barriers
    and TMA on the CPU) otherwise, race detection on when asked (slower: tests)."""
    return plgpu.InterpretGPUParams(detect_races=detect_races) if interpret else False


# With 4+ warpgroup threads per program (the attention kernel at 3+ query heads per KV head),
# the GPU interpreter has stalled for good on a 2-core machine: compute warpgroups wait at the
# first barrier while the producer thread never starts (our reading: each warpgroup is an
# XLA:CPU execution blocked in a host callback, and with fewer cores than warpgroups the
# producer's execution is not scheduled). Below this many cores such programs are not run.
STALL_FREE_CORES = 4


def interpret_stall(interpret, num_warpgroups: int) -> str | None:
    """Why a kernel of `num_warpgroups` should not run in the GPU interpreter on this machine
    (None: it can). Compiled kernels (interpret False) always run."""
    cores = os.cpu_count() or 1
    if interpret and num_warpgroups >= 4 and cores < STALL_FREE_CORES:
        return (f"{num_warpgroups} warpgroups in the GPU interpreter need >= "
                f"{STALL_FREE_CORES} CPU cores (it stalls on fewer; this machine has {cores})")
    return None
