"""machine.describe: a benchmark header names the CPU and the features its paths depend on."""

from jaxserve.tools.machine import cpu_features, cpu_name, describe

INTEL_AMX = ["processor\t: 0", "model name\t: Intel(R) Xeon(R) Platinum 8480+",
             "flags\t\t: fpu avx avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8"]
AMD = ["model name\t: AMD EPYC 9B14", "flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16"]
OLD = ["model name\t: Intel(R) Core(TM) i7-4770", "flags\t\t: fpu sse4_2 avx avx2"]


def test_features_and_names_from_cpuinfo():
    assert cpu_name(AMD) == "AMD EPYC 9B14"
    assert cpu_features(INTEL_AMX) == ["AMX-INT8", "AMX-BF16", "AVX-512 VNNI", "AVX-512 BF16",
                                       "AVX-512F", "AVX2"]
    assert cpu_features(OLD) == ["AVX2"]
    assert describe(AMD).startswith("AMD EPYC 9B14, ") and describe(AMD).endswith(
        "AVX-512 VNNI, AVX-512 BF16, AVX-512F, AVX2, no AMX")
    assert "no AMX" not in describe(INTEL_AMX) and "AMX-INT8" in describe(INTEL_AMX)
    assert "no AMX" not in describe([])  # nothing known: nothing claimed
