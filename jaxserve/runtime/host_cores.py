"""CPUs of the host loop's own, apart from XLA's CPU thread pool.

On the CPU backend the "device" is XLA's intra-op thread pool, which by default takes every CPU
of the process, the host loop's included: the engine's host work (scheduling, inputs, outputs)
then competes with the step it should hide behind. `reserve_host_cores(n)` starts JAX's backends
with the process limited to all but `n` CPUs (XLA sizes its pool and starts its threads from the
affinity it sees then) and afterwards gives the calling thread the `n` others; threads it starts
later (the server's engine loop, its HTTP workers, background compiles) inherit those, so they
share the host loop's CPUs. vLLM's CPU backend likewise keeps a CPU off its OpenMP workers for
its scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU, 1 by default there). It pays when the host
work per step is comparable to the device's (small models, many sequences); a model whose step
is mostly matmul loses the reserved CPUs' share of the compute (docs/performance.md, "The
engine loop: host cost per step"). On a GPU machine the pool runs only XLA's host-side work, so
one reserved core should cost little there (not measured yet: no GPU has been lent).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

# XLA names its CPU pool threads so (Linux truncates a thread name to 15 characters).
POOL_THREAD_NAME = "tf_XLAEigen"


@dataclasses.dataclass(frozen=True)
class HostCores:
    host: frozenset[int]    # the calling thread's CPUs
    device: frozenset[int]  # XLA's pool's CPUs
    pool_threads: int       # XLA pool threads found after the backend started

    def describe(self) -> str:
        threads = f"{self.pool_threads} thread{'' if self.pool_threads == 1 else 's'}"
        return (f"host loop on CPU {_cpus(self.host)}, XLA's pool on CPU {_cpus(self.device)} "
                f"({threads})")


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def pool_threads() -> dict[int, frozenset[int]]:
    """XLA CPU pool threads of this process: thread id -> its CPUs (Linux /proc)."""
    found = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name == POOL_THREAD_NAME:
            found[int(task.name)] = frozenset(os.sched_getaffinity(int(task.name)))
    return found


def reserve_host_cores(n: int) -> HostCores:
    """Gives the calling thread `n` CPUs of its own and starts JAX's backends on the others.

    Call it before anything starts a JAX backend (any device array, `jax.devices()`, a jit
    call): XLA's pool is sized and started once, when the backend starts. Raises ValueError for
    an `n` the process's CPUs cannot give, RuntimeError when the backend already runs.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("reserving host cores needs os.sched_setaffinity (Linux)")
    cpus = sorted(os.sched_getaffinity(0))
    if not isinstance(n, int) or not 1 <= n < len(cpus):
        raise ValueError(f"host cores must be an integer in [1, {len(cpus) - 1}] (this process "
                         f"may run on {len(cpus)} CPUs and XLA's pool needs at least one), "
                         f"got {n!r}")
    if pool_threads():
        raise RuntimeError("JAX's CPU backend already runs (its pool was sized when it "
                           "started): reserve host cores before anything touches a device "
                           "(first thing in the process)")
    import jax
    host, device = frozenset(cpus[-n:]), frozenset(cpus[:-n])
    os.sched_setaffinity(0, device)
    try:
        jax.devices()  # starts the backends: XLA's pool threads start now, on `device`
    finally:
        os.sched_setaffinity(0, host)
    return HostCores(host=host, device=device, pool_threads=len(pool_threads()))
