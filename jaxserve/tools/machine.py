"""What a benchmark says about the machine it ran on: every figure names its CPU and the
instruction-set features the CPU paths depend on (AMX, AVX-512 VNNI/BF16, AVX2)."""

from __future__ import annotations

import os
import platform

# (/proc/cpuinfo flag, how docs name it), most specific first: XLA:CPU's int8 and bf16 dots
# and the native kernels take different paths on each.
FEATURES = (("amx_int8", "AMX-INT8"), ("amx_bf16", "AMX-BF16"),
            ("avx512_vnni", "AVX-512 VNNI"), ("avx512_bf16", "AVX-512 BF16"),
            ("avx512f", "AVX-512F"), ("avx_vnni", "AVX-VNNI"), ("avx2", "AVX2"))


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def cpu_name(lines: list[str] | None = None) -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform reports."""
    for line in _cpuinfo() if lines is None else lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_features(lines: list[str] | None = None) -> list[str]:
    """The FEATURES this CPU has, by their docs names (empty where /proc/cpuinfo is not)."""
    for line in _cpuinfo() if lines is None else lines:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [name for flag, name in FEATURES if flag in flags]
    return []


def describe(lines: list[str] | None = None) -> str:
    """One line for a benchmark's header, e.g. "AMD EPYC, 2 CPUs, AVX-512 VNNI, AVX-512 BF16,
    AVX-512F, AVX2, no AMX"."""
    lines = _cpuinfo() if lines is None else lines
    features = cpu_features(lines)
    amx = "" if any(f.startswith("AMX") for f in features) or not features else ", no AMX"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ", ".join([cpu_name(lines), f"{cpus} CPUs", *features]) + amx
