"""Lowers (and, with jax-cuda13-plugin installed, compiles) jitted code for an H200 from a CPU.

Lowering catches Triton-backend errors (non-power-of-2 blocks, unsupported ops) without a GPU;
see docs/gpu.md.
"""

from __future__ import annotations

import jax

# The H200's GpuTargetConfigProto: one copy, the one the deviceless step report compiles with.
from jaxserve.tools.deviceless import H200_TARGET_CONFIG  # noqa: F401 (used by the tests)

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, *args):
    """Lowers `jax.jit(fn)` for CUDA; args are jax.ShapeDtypeStruct (or arrays). Returns text."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()




def cuda_compiler_available() -> str | None:
    """None when a deviceless CUDA compile can run here, else why not (for a skip message)."""
    import importlib.util
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        found = False
    if not found:
        return ("jax-cuda13-plugin is not installed (pip install jax-cuda13-plugin==%s "
                "jax-cuda13-pjrt==%s)" % (jax.__version__, jax.__version__))
    try:
        _h200_topology()
    except Exception as e:  # noqa: BLE001 - any plugin failure means "cannot compile here"
        return f"CUDA topology unavailable: {type(e).__name__}: {e}"
    return None


def _h200_topology():
    from jaxserve.tools.deviceless import h200_topology
    return h200_topology()


def compile_for_h200(fn, *args):
    """Compiles `jax.jit(fn)` to an sm_90a executable on compile-only H200 devices (no GPU needed).

    Needs jax-cuda13-plugin and jax-cuda13-pjrt at jax's version; args are ShapeDtypeStructs.
    Returns the compiled executable; raises on Triton/ptxas errors such as shared-memory overflow.
    """
    topo = _h200_topology()
    mesh = jax.sharding.Mesh(topo.devices, ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args]
    # A compile-only client cannot deserialize cached executables: keep these out of the cache.
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.set_mesh(mesh):
            return jax.jit(fn).trace(*specs).lower().compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
