"""The `interpret` argument of the Mosaic GPU kernels from the engine's interpret flag, and
when the GPU interpreter can run a kernel on this machine."""

from __future__ import annotations

import os

from jax.experimental.pallas import mosaic_gpu as plgpu


def mosaic_interpret(interpret: bool, detect_races: bool = False):
    """False on a GPU; JAX's GPU interpret mode (simulated threads, shared memory, barriers
    and TMA on the CPU) otherwise, race detection on when asked (slower: tests)."""
    return plgpu.InterpretGPUParams(detect_races=detect_races) if interpret else False


# The GPU interpreter runs each warpgroup of a program as an XLA:CPU execution on its own
# thread, and a barrier wait blocks inside a host callback. XLA:CPU runs those callbacks on
# its client's thread pool, sized by the NPROC environment variable when jax starts (else the
# CPU count): with fewer pool threads than warpgroups, the blocked waits can hold every pool
# thread while the warpgroup that would complete the barrier never gets one, and the program
# hangs for good (seen on 2 cores: two callbacks blocked in barrier waits, the others' waiting
# for a thread; with NPROC=8 the same case runs in 12 s). Set it only for processes that
# interpret such kernels: the engine sizes its own pool from the CPUs it is given
# (jaxserve/runtime/host_cores.py), which NPROC overrides.
POOL_ENV = "NPROC"
POOL_THREADS = 8  # enough for the kernels' at most 5 warpgroups


def callback_threads() -> int:
    """Threads of XLA:CPU's pool in this process: its own reading of the environment
    (PORTABLE_NPROC, then NPROC, else the CPU count)."""
    for name in ("PORTABLE_NPROC", POOL_ENV):
        value = os.environ.get(name, "")
        if value.strip().lstrip("-").isdigit():
            return max(0, int(value))
    return os.cpu_count() or 1


def interpret_stall(interpret, num_warpgroups: int) -> str | None:
    """Why a kernel of `num_warpgroups` should not run in the GPU interpreter in this process
    (None: it can). Compiled kernels (interpret False) always run."""
    threads = callback_threads()
    if interpret and threads < num_warpgroups:
        return (f"{num_warpgroups} warpgroups in the GPU interpreter need XLA:CPU's pool to "
                f"have as many threads ({threads} here): set {POOL_ENV}={POOL_THREADS} "
                f"before jax starts")
    return None
