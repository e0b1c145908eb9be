"""The `interpret` argument of the Mosaic GPU kernels from the engine's interpret flag."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu


def mosaic_interpret(interpret: bool, detect_races: bool = False):
    """False on a GPU; JAX's GPU interpret mode (simulated threads, shared memory, barriers
    and TMA on the CPU) otherwise, race detection on when asked (slower: tests)."""
    return plgpu.InterpretGPUParams(detect_races=detect_races) if interpret else False
