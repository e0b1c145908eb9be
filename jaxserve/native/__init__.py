"""Native CPU kernels called through the XLA FFI: built from source on this machine, cached.

The library is compiled with the machine's C++ compiler against the FFI headers jaxlib ships,
once per instruction-set level (jaxserve/native/isa.py: AVX-512 VNNI, AVX2, baseline x86-64),
and the level the CPU has is loaded. Each build lives in a cache directory under its level's
name and a hash of the source, the flags and the jaxlib version, so an edit or an upgrade
rebuilds it, two checkouts never share a stale one, and a cache that moves to another CPU
never hands it instructions it lacks.
`scripts/setup.sh` builds it (`python -m jaxserve.native`); a first use builds it too. Where no
compiler is available, `load()` says why and callers fall back to the pure-XLA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax

from jaxserve.native.isa import IsaBuild, chosen

log = logging.getLogger("jaxserve")

SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                for name in ("cpu_attention.cc", "cpu_quant_matmul.cc", "cpu_float_matmul.cc"))
# Included by the sources: part of the cache key too.
HEADERS = tuple(pathlib.Path(__file__).with_name(name) for name in ("cpu_work.h",))
FLAGS = ("-O3", "-ffast-math", "-std=c++17", "-fPIC", "-shared")  # + the level's (isa.py)
# Handler symbols in the library and the FFI target names they are registered under.
TARGETS = {"jaxserve_ragged_paged_attention": "JaxserveRaggedPagedAttention",
           "jaxserve_ragged_paged_attention_int8": "JaxserveRaggedPagedAttentionInt8",
           "jaxserve_quant_matmul": "JaxserveQuantMatmul",
           "jaxserve_float_matmul": "JaxserveFloatMatmul"}


class NativeUnavailable(RuntimeError):
    """The native library could not be built or loaded here (the message says why)."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXSERVE_NATIVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxserve", "native")
    return pathlib.Path(root)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise NativeUnavailable("no C++ compiler found (install g++ or set CXX)")
    return cxx


def library_path(isa: IsaBuild | None = None) -> pathlib.Path:
    isa = isa or chosen()
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join((*FLAGS, *isa.flags)).encode())
    h.update(jax.ffi.include_dir().encode())
    h.update(jax.__version__.encode())
    return cache_dir() / f"libjaxserve_cpu-{isa.name}-{h.hexdigest()[:16]}.so"


def build(isa: IsaBuild | None = None) -> pathlib.Path:
    """Compiles the library for `isa` (default: this machine's level) if this source/flags/
    jaxlib has none yet; returns its path."""
    isa = isa or chosen()
    path = library_path(isa)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [_compiler(), *FLAGS, *isa.flags, "-I", jax.ffi.include_dir(), *map(str, SOURCES)]
    # Written beside its final name, then renamed: concurrent builds never see a partial file.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        part = pathlib.Path(tmp.name)
    try:
        res = subprocess.run([*cmd, "-o", str(part)], capture_output=True, text=True)
        if res.returncode:
            raise NativeUnavailable(f"compiling {', '.join(s.name for s in SOURCES)} failed "
                                    f"({isa.name} build):\n{res.stderr[-2000:]}")
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)
    return path


@functools.cache
def load() -> ctypes.CDLL:
    """Builds this machine's level if needed, loads it, and registers the FFI targets (once per
    process)."""
    isa = chosen()
    lib = ctypes.cdll.LoadLibrary(str(build(isa)))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    log.info("native CPU kernels: the %s build", isa.name)
    return lib


def load_build(isa: IsaBuild, suffix: str) -> ctypes.CDLL:
    """Another level's build beside the loaded one, its targets registered as `<target>_<suffix>`
    (tests run the lower levels' loops on this machine this way)."""
    lib = ctypes.cdll.LoadLibrary(str(build(isa)))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(f"{target}_{suffix}", jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return lib


def unavailable_reason() -> str | None:
    """None when the native kernels load here; else why not."""
    try:
        load()
    except (NativeUnavailable, OSError) as e:
        return str(e)
    return None
