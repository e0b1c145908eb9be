"""Which native build a CPU loads (jaxserve/native/isa.py): the most capable instruction-set
level its flags allow, each level compiled under its own name; the loops of the levels this
CPU runs are checked against their references in test_cpu_quant_matmul / test_cpu_float_matmul."""

from __future__ import annotations

import pytest

from jaxserve import native
from jaxserve.native import isa

# /proc/cpuinfo flags lines, cut to what matters, from the machines this project has run on.
SAPPHIRE_RAPIDS = ("flags : fpu sse2 avx avx2 fma f16c bmi2 movbe avx512f avx512dq avx512cd "
                   "avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8")
EPYC_ZEN4 = ("flags : fpu sse2 avx avx2 fma f16c bmi2 movbe avx512f avx512dq avx512cd avx512bw "
             "avx512vl avx512_vnni avx512_bf16")
HASWELL = "flags : fpu sse2 avx avx2 fma f16c bmi2 movbe"
SKYLAKE_X_NO_VNNI = HASWELL + " avx512f avx512dq avx512cd avx512bw avx512vl"
SANDY_BRIDGE = "flags : fpu sse2 avx"


@pytest.mark.parametrize("cpuinfo,want", [
    (SAPPHIRE_RAPIDS, "avx512-vnni"), (EPYC_ZEN4, "avx512-vnni"),
    (SKYLAKE_X_NO_VNNI, "avx2"), (HASWELL, "avx2"), (SANDY_BRIDGE, "x86-64"), ("", "x86-64")])
def test_the_most_capable_level_the_flags_allow(cpuinfo, want):
    assert isa.select(isa.cpu_flags(cpuinfo), machine="x86_64").name == want


def test_other_architectures_build_for_themselves():
    assert isa.select(isa.cpu_flags(EPYC_ZEN4), machine="aarch64") is isa.NATIVE


def test_a_forced_level_is_used_and_a_bad_one_refused(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx2")
    assert isa.chosen().name == "avx2"
    monkeypatch.setenv(isa.ENV, "avx9")
    with pytest.raises(ValueError, match="JAXSERVE_NATIVE_ISA='avx9': must be one of"):
        isa.chosen()


def test_every_level_compiles_under_its_own_name():
    """A cache that moves to another CPU must never hand it a build for a level it lacks: each
    level's library is its own file. (Built by scripts/setup.sh --test; cached.)"""
    paths = {b.name: native.build(b) for b in isa.ISA_BUILDS}
    assert len(set(paths.values())) == len(isa.ISA_BUILDS)
    for name, path in paths.items():
        assert path.exists() and f"-{name}-" in path.name
