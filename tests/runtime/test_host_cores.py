"""reserve_host_cores: XLA's CPU pool on all CPUs but the host loop's (jaxserve/runtime/
host_cores.py). Each check runs in a fresh interpreter: the pool is started once per process."""

import json
import os
import subprocess
import sys

import pytest

from jaxserve.runtime.host_cores import POOL_THREAD_NAME, reserve_host_cores

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs a process with >= 2 CPUs (Linux)")

PROBE = """
import json, os, pathlib, threading
from jaxserve.runtime.host_cores import reserve_host_cores
cores = reserve_host_cores(1)
import jax, jax.numpy as jnp
seen = {}
for task in pathlib.Path("/proc/self/task").iterdir():
    name = (task / "comm").read_text().strip()
    seen.setdefault(name, []).append(sorted(os.sched_getaffinity(int(task.name))))
later = []
t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
value = float(jnp.arange(4.0).sum())  # the backend computes
print(json.dumps({"host": sorted(cores.host), "device": sorted(cores.device),
                  "pool_threads": cores.pool_threads, "main": sorted(os.sched_getaffinity(0)),
                  "seen": seen, "later": later[0], "value": value}))
"""


def run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@needs_two
@pytest.mark.subprocess
def test_pool_starts_on_the_other_cpus_and_the_host_keeps_its_own():
    got = run(PROBE)
    assert got.returncode == 0, got.stderr
    r = json.loads(got.stdout.splitlines()[-1])
    assert r["host"] == CPUS[-1:] and r["device"] == CPUS[:-1]
    assert r["main"] == CPUS[-1:]  # the calling thread: the host loop's CPU
    assert r["later"] == CPUS[-1:]  # threads it starts afterwards inherit it
    pool = r["seen"][POOL_THREAD_NAME]
    assert r["pool_threads"] == len(pool) == len(CPUS) - 1  # sized from the affinity it saw
    assert all(cpus == CPUS[:-1] for cpus in pool)
    assert r["value"] == 6.0


@needs_two
@pytest.mark.subprocess
def test_refused_once_the_backend_runs():
    got = run("import jax; jax.devices()\n"
              "from jaxserve.runtime.host_cores import reserve_host_cores\n"
              "reserve_host_cores(1)")
    assert got.returncode != 0
    assert "already runs" in got.stderr and "before anything touches a device" in got.stderr


@pytest.mark.parametrize("n", [0, -1, len(CPUS), 1.5, "1"])
def test_counts_the_process_cannot_give_are_refused(n):
    if not CPUS:
        pytest.skip("needs os.sched_getaffinity (Linux)")
    with pytest.raises(ValueError, match=r"host cores must be an integer in \[1, "):
        reserve_host_cores(n)
