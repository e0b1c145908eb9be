"""Lowers (and, with jax-cuda13-plugin installed, compiles) jitted code for an H200 from a CPU.

Lowering catches Triton-backend errors (non-power-of-2 blocks, unsupported ops) without a GPU;
see docs/gpu.md.
"""

from __future__ import annotations

import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, *args):
    """Lowers `jax.jit(fn)` for CUDA; args are jax.ShapeDtypeStruct (or arrays). Returns text."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


# GpuTargetConfigProto (text format) of an H200: sm_90, 132 SMs; shared-memory and register limits
# are what the compiler checks kernels against.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version {
  major: 13
  minor: 0
  patch: 0
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 12
}
device_description_str: "NVIDIA H200"
"""


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
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET_CONFIG,
                                        topology="1x1x1")


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
