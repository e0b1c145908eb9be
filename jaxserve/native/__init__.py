"""Native CPU kernels called through the XLA FFI: built from source on this machine, cached.

The library is compiled with the machine's C++ compiler (`-march=native`) against the FFI
headers jaxlib ships, into a cache directory keyed by a hash of the source, the flags and the
jaxlib version, so an edit or an upgrade rebuilds it and two checkouts never share a stale one.
`scripts/setup.sh` builds it (`python -m jaxserve.native`); a first use builds it too. Where no
compiler is available, `load()` says why and callers fall back to the pure-XLA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax

SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                for name in ("cpu_attention.cc", "cpu_quant_matmul.cc", "cpu_float_matmul.cc"))
# Included by the sources: part of the cache key too.
HEADERS = tuple(pathlib.Path(__file__).with_name(name) for name in ("cpu_work.h",))
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-shared")
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


def library_path() -> pathlib.Path:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(jax.ffi.include_dir().encode())
    h.update(jax.__version__.encode())
    return cache_dir() / f"libjaxserve_cpu-{h.hexdigest()[:16]}.so"


def build() -> pathlib.Path:
    """Compiles the library if this source/flags/jaxlib has none yet; returns its path."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [_compiler(), *FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES)]
    # Written beside its final name, then renamed: concurrent builds never see a partial file.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        part = pathlib.Path(tmp.name)
    try:
        res = subprocess.run([*cmd, "-o", str(part)], capture_output=True, text=True)
        if res.returncode:
            raise NativeUnavailable(f"compiling {', '.join(s.name for s in SOURCES)} failed:\n{res.stderr[-2000:]}")
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)
    return path


@functools.cache
def load() -> ctypes.CDLL:
    """Builds if needed, loads, and registers the FFI targets (once per process)."""
    lib = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return lib


def unavailable_reason() -> str | None:
    """None when the native kernels load here; else why not."""
    try:
        load()
    except (NativeUnavailable, OSError) as e:
        return str(e)
    return None
