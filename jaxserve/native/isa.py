"""Which build of the native CPU kernels a machine loads: one build per x86 instruction-set
level, chosen at start-up from the CPU's flags.

A library built with `-march=native` runs only on CPUs like the one that built it, and the
build cache outlives the machine (our CI and development VMs change CPU model between
sessions: an Intel with AMX, then an AMD EPYC without it). So each level is compiled with
explicit flags and cached under its own name, and `select` picks the most capable level the
CPU has:

    avx512-vnni  x86-64-v4 + VNNI: Intel Ice Lake and later (Sapphire Rapids with AMX too),
                 AMD Zen 4/5. The quantized matmul's vpdpbusd loop, the float matmul's and the
                 attention's AVX-512 loops.
    avx2         x86-64-v3 (AVX2, FMA, F16C): Haswell to Alder Lake, Zen 1-3. The quantized
                 matmul's vpmaddubsw loop; attention and float matmul in their portable loops,
                 vectorized by the compiler.
    x86-64       any x86-64: the portable loops (the engine prefers XLA for linears here).
    native       other architectures: `-march=native`, as built.

AMX has no loop of its own here: where a CPU has it, XLA's oneDNN int8 and bf16 dots use it
(the w8a8 path's linears); the native kernels run their AVX-512 VNNI build beside them.
`JAXSERVE_NATIVE_ISA=<name>` forces a build (tests use it to run the lower levels here).
"""

from __future__ import annotations

import dataclasses
import os
import platform


@dataclasses.dataclass(frozen=True)
class IsaBuild:
    name: str
    needs: frozenset  # /proc/cpuinfo flags the build's instructions need
    flags: tuple      # compiler flags that select them


ISA_BUILDS = (  # most capable first
    IsaBuild("avx512-vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq",
                                       "avx512cd", "avx512_vnni", "avx2", "fma", "f16c",
                                       "bmi2"}),
             ("-march=x86-64-v4", "-mavx512vnni")),
    IsaBuild("avx2", frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"}), ("-march=x86-64-v3",)),
    IsaBuild("x86-64", frozenset(), ("-march=x86-64",)),
)
NATIVE = IsaBuild("native", frozenset(), ("-march=native",))
BY_NAME = {b.name: b for b in (*ISA_BUILDS, NATIVE)}
ENV = "JAXSERVE_NATIVE_ISA"


def cpu_flags(cpuinfo: str | None = None) -> frozenset:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def select(flags: frozenset, machine: str | None = None) -> IsaBuild:
    """The most capable build these CPU flags run (`native` off x86-64)."""
    machine = machine or platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return NATIVE
    return next(b for b in ISA_BUILDS if b.needs <= flags)


def chosen() -> IsaBuild:
    """This machine's build, or the one $JAXSERVE_NATIVE_ISA names."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in BY_NAME:
            raise ValueError(f"{ENV}={forced!r}: must be one of {sorted(BY_NAME)}")
        return BY_NAME[forced]
    return select(cpu_flags())
