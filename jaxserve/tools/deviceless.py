"""Compiling for an H200 on a machine without one (jax-cuda13-plugin's compile-only client).

`compile_for_h200` compiles a jitted function to an sm_90a executable against a topology of
compile-only H200 devices, optionally dumping XLA's thunk sequence and optimized HLO and
capturing ptxas' register/spill report (`-v`) through a ptxas wrapper handed to XLA as its CUDA
directory. See docs/gpu.md: neither a launch failure nor a wrong result shows here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import pathlib
import shutil
import tempfile
import time

import jax

# GpuTargetConfigProto (text format) of an H200: sm_90, 132 SMs; shared-memory and register
# limits are what the compiler checks kernels against.
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

# Where a CUDA toolkit (bin/ptxas and nvvm/libdevice) may live, in the order tried.
CUDA_ROOTS = ("CUDA_HOME", "CUDA_PATH")
CUDA_DIRS = ("/usr/local/cuda", "/usr/local/cuda-13.0", "/usr/local/cuda-13")

_WRAPPER = """#!/bin/sh
# ptxas with -v, its report appended to a log XLA never reads (XLA still sees its stderr);
# with a PTX directory, its input (XLA passes the PTX file first, without an extension) is
# copied there first as N.ptx, N counting calls.
keep="{keep}"
if [ -n "$keep" ] && [ -f "$1" ]; then
  cp "$1" "$keep/$(ls "$keep" | wc -l).ptx"
fi
err=$(mktemp)
"{real}" -v "$@" 2>"$err"
rc=$?
cat "$err" >> "{log}"
cat "$err" >&2
rm -f "$err"
exit $rc
"""


def load_mosaic_gpu_runtime() -> None:
    """Makes the plugin's Mosaic GPU runtime (its TMA-descriptor and launch functions) visible
    to the host code XLA links for a `plgpu.kernel` call. A GPU client loads it; without one,
    a deviceless compile of a Mosaic GPU kernel fails with "Symbols not found:
    mosaic_gpu_launch_kernel" unless it is loaded first, globally. No-op when absent."""
    spec = importlib.util.find_spec("jax_plugins.xla_cuda13")
    if spec is None or not spec.submodule_search_locations:
        return
    for location in spec.submodule_search_locations:
        found = sorted(pathlib.Path(location).parents[1].glob(
            "jax_cuda13_plugin/libmosaic_gpu_runtime.so"))
        if found:
            ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL)
            return


def h200_topology(num_devices: int = 1):
    from jax.experimental import topologies
    load_mosaic_gpu_runtime()
    return topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET_CONFIG,
                                        topology=f"1x1x{num_devices}")


def unavailable_reason() -> str | None:
    """None when a deviceless CUDA compile can run here, else why not (for a skip message)."""
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        found = False
    if not found:
        return ("jax-cuda13-plugin is not installed (pip install jax-cuda13-plugin==%s "
                "jax-cuda13-pjrt==%s; scripts/setup.sh --test puts them in .cuda-plugin/)"
                % (jax.__version__, jax.__version__))
    try:
        h200_topology()
    except Exception as e:  # noqa: BLE001 - any plugin failure means "cannot compile here"
        return f"CUDA topology unavailable: {type(e).__name__}: {e}"
    return None


def cuda_root() -> pathlib.Path | None:
    """A CUDA toolkit directory with ptxas and libdevice, or None."""
    candidates = [os.environ.get(v) for v in CUDA_ROOTS] + list(CUDA_DIRS)
    for c in filter(None, candidates):
        p = pathlib.Path(c)
        if (p / "bin" / "ptxas").is_file() and (p / "nvvm" / "libdevice").is_dir():
            return p.resolve()
    return None


def _ptxas_wrapper_dir(root: pathlib.Path, work: pathlib.Path, log: pathlib.Path,
                      keep: pathlib.Path | None = None) -> str:
    """A CUDA directory mirroring `root` whose bin/ptxas logs its -v report to `log` (and copies
    each PTX file it compiles into `keep`, when given)."""
    cuda = work / "cuda"
    (cuda / "bin").mkdir(parents=True)
    for entry in root.iterdir():
        if entry.name != "bin":
            (cuda / entry.name).symlink_to(entry)
    for tool in (root / "bin").iterdir():
        if tool.name != "ptxas":
            (cuda / "bin" / tool.name).symlink_to(tool)
    wrapper = cuda / "bin" / "ptxas"
    wrapper.write_text(_WRAPPER.format(real=root / "bin" / "ptxas", log=log, keep=keep or ""))
    wrapper.chmod(0o755)
    return str(cuda)


@dataclasses.dataclass(frozen=True)
class DevicelessCompile:
    compiled: jax.stages.Compiled
    compile_s: float
    dump_dir: pathlib.Path
    ptxas_log: str             # ptxas -v output ("" when none was captured)
    ptxas_note: str | None     # why no ptxas report was captured, if none was


def compile_for_h200(fn, args, *, dump_dir: str | pathlib.Path, donate_argnums=(),
                     compiler_options: dict | None = None, ptxas: bool = True,
                     jit_kwargs: dict | None = None, keep_ptx: bool = False) -> DevicelessCompile:
    """Compiles `jax.jit(fn)` for one compile-only H200 on `args` (ShapeDtypeStructs or arrays;
    their shapes only), dumping XLA's files into `dump_dir`. Raises on compile errors (Triton,
    ptxas, shared memory). `keep_ptx` copies every PTX file ptxas compiles into
    `dump_dir`/ptx (XLA's own dump has none when it runs ptxas as a subprocess)."""
    topo = h200_topology()
    mesh = jax.sharding.Mesh(topo.devices, ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                         args)
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-deviceless-"))
    dump = pathlib.Path(dump_dir)
    options = {"xla_dump_to": str(dump), "xla_dump_hlo_as_text": True,
               **(compiler_options or {})}
    log, note = work / "ptxas.log", None
    root = cuda_root() if ptxas else None
    if root is not None:
        keep = None
        if keep_ptx:
            keep = dump / "ptx"
            keep.mkdir(parents=True, exist_ok=True)
        options["xla_gpu_cuda_data_dir"] = _ptxas_wrapper_dir(root, work, log, keep)
    elif ptxas:
        note = (f"no CUDA toolkit with bin/ptxas and nvvm/libdevice in ${'/$'.join(CUDA_ROOTS)} "
                f"or {', '.join(CUDA_DIRS)}")
    # A compile-only client cannot deserialize cached executables: keep these out of the cache.
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.set_mesh(mesh):
            lowered = jax.jit(fn, donate_argnums=donate_argnums, **(jit_kwargs or {})).trace(
                *specs).lower()
            start = time.perf_counter()
            compiled = lowered.compile(compiler_options=options)
            seconds = time.perf_counter() - start
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    text = log.read_text() if log.exists() else ""
    if root is not None and not text:
        note = f"XLA did not run ptxas from {root} (it may use its built-in PTX compiler)"
    shutil.rmtree(work, ignore_errors=True)
    return DevicelessCompile(compiled, seconds, dump, text, note)
