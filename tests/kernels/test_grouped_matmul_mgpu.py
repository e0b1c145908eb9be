"""Mosaic GPU grouped matmul (pallas_kernels/grouped_matmul_mgpu.py) in the GPU interpreter
with race detection (the detector prints "RACE DETECTED" to stdout: every run asserts it is
absent), against the same float64 per-group loop and dense reference as the Triton kernel
(test_grouped_matmul.py's grid of group sizes), plus refusals, the schedule's row tiles, and
deviceless sm_90a compiles.

Tolerances: test_grouped_matmul.TOL. bf16 inputs give exact products and f32 sums on every
side (the result is f32, never rounded to bf16), so the Triton kernel's bound holds.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import test_grouped_matmul as gmm
from pallas_kernels.grouped_matmul import num_items
from pallas_kernels.grouped_matmul_mgpu import cost, grouped_matmul_mgpu, pick_tm, unsupported
from tests import cuda_lowering
from tests.cuda_lowering import lower_for_h200

RACES = plgpu.InterpretGPUParams(detect_races=True)
BF16 = jnp.bfloat16
# K = 320: five pipeline steps of 64, more than the 4 buffers, so slots are refilled;
# N = 192: three 64-column blocks.
K, N = 320, 192


def _run(capfd, sizes, k=K, n=N, dtype=BF16, int8=False, extra_rows=0, **kw):
    x, w, gs, scales = gmm._case(sizes, k, n, dtype, int8=int8, extra_rows=extra_rows)
    got = grouped_matmul_mgpu(x, w, gs, scales, interpret=RACES, **kw)
    assert "RACE DETECTED" not in capfd.readouterr().out
    assert got.dtype == jnp.float32 and got.shape == (x.shape[0], n)
    gmm._check_all(got, x, w, gs, scales)
    return got


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("sizes", gmm.SIZES, ids=str)
def test_matches_references(sizes, int8, capfd):
    """The Triton kernel's grid of group sizes (empty groups, boundaries inside tiles, routed
    top-k batches, M = 300 in 128-row tiles) with bf16 weights and with int8 codes."""
    _run(capfd, sizes, int8=int8)


@pytest.mark.parametrize("tm", [8, 16, 128])
def test_explicit_row_tiles(tm, capfd):
    """Items of 8 rows (groups over several tiles, each tile's weights read again) and of 128
    (one tile holding every group)."""
    _run(capfd, [10, 7, 0, 20], tm=tm)
    _run(capfd, gmm._routed_sizes(8, 2, 19, 1), int8=True, tm=tm)


def test_one_k_step_f16_and_rows_in_no_group(capfd):
    """K = 64 (one step, one buffer), f16 activations, and rows past the groups (zeros)."""
    _run(capfd, [3, 0, 5], k=64, n=64)
    _run(capfd, [3, 0, 5], k=64, n=64, int8=True)
    _run(capfd, [10, 7, 0, 20], dtype=jnp.float16)
    got = _run(capfd, [2, 0, 3], int8=True, extra_rows=20)
    assert not np.asarray(got)[5:].any()


def test_race_detector_sees_this_kernel(capfd, monkeypatch):
    """The int8 path's fence between the converted codes' stores and the wgmma reading them
    (commit_smem), removed: the detector flags it, so the checks above can fail. (A shape of
    its own: a cached trace of the kernel would keep the fence.)"""
    monkeypatch.setattr(plgpu, "commit_smem", lambda: None)
    x, w, gs, scales = gmm._case([10, 7, 0, 21], 128, 128, BF16, int8=True)
    grouped_matmul_mgpu(x, w, gs, scales, interpret=RACES).block_until_ready()
    assert "RACE DETECTED" in capfd.readouterr().out


@pytest.mark.parametrize("k,n,dtype,w_dtype,match", [
    (128, 128, jnp.float32, None, "bfloat16 or float16"),
    (96, 128, BF16, None, "K=96 and N=128 must be multiples of 64"),
    (128, 100, BF16, jnp.int8, "multiples of 64"),
    (128, 128, BF16, jnp.float32, "weights must be bfloat16 or int8"),
])
def test_refused_shapes_raise(k, n, dtype, w_dtype, match):
    assert match in unsupported(k, n, dtype, w_dtype)
    x = jnp.zeros((4, k), dtype)
    if w_dtype == jnp.int8:
        w, scales = jnp.zeros((2, n, k), jnp.int8), jnp.ones((2, n), jnp.float32)
    else:
        w, scales = jnp.zeros((2, k, n), w_dtype or dtype), None
    with pytest.raises(ValueError, match=match):
        grouped_matmul_mgpu(x, w, jnp.array([2, 2], jnp.int32), scales)


def test_row_tile_must_suit_wgmma():
    x, w, gs, _ = gmm._case([3, 5], 64, 64, BF16)
    with pytest.raises(ValueError, match="tm=12 must be a multiple of 8"):
        grouped_matmul_mgpu(x, w, gs, tm=12)


def test_pick_tm_and_cost():
    """Rows per item: a mean group's rows (of the groups M rows can fill), rounded up to 8,
    at most 128. The cost counts the weights of at most min(E, M) groups and the item
    outputs written and gathered."""
    cases = {(1, 64): 8, (2, 64): 8, (512, 64): 8, (128, 8): 16, (512, 8): 64, (300, 4): 80,
             (8192, 64): 128, (100, 1): 104}
    assert {c: pick_tm(*c) for c in cases} == cases
    m, e, k, n = 2, 64, 2048, 768  # one token's top-2 of 64 experts
    c = cost(m, e, k, n)
    items = num_items(m, e, 8)
    outputs = 4 * items * n * 8
    assert c["bytes"] == (2 * k * n * 2 + (2 * m * k + 2 * 8 * k + 4 * 32 * items)
                          + 2 * 8 * k + 2 * outputs + 4 * m * n)
    assert cost(m, e, k, n, int8=True)["bytes"] == c["bytes"] - 2 * k * n + 4 * e * n
    assert c["flops"] == 2 * m * k * n and c["launches"] == 3


def _fn(x, w, gs, *scales):
    return grouped_matmul_mgpu(x, w, gs, *scales)


@pytest.mark.parametrize("m,int8", [(2, False), (512, True), (8192, False)])
def test_lowers_and_compiles_for_h200(m, int8):
    """OLMoE-shaped gate/up projections (64 experts, D 2048 -> F 1024): one token's top-2,
    a batch-64 top-8 decode with int8 codes (8-row tiles), a prefill chunk in 128-row tiles.
    The kernel is one Mosaic GPU call writing [items, N, tm] f32, gathered into rows with no
    transpose; no dot is left to XLA."""
    e, k, n = 64, 2048, 1024
    args = gmm._h200_args(m, e, k, n, BF16, int8)
    assert "mosaic_gpu" in lower_for_h200(_fn, *args)
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    text = cuda_lowering.compile_for_h200(_fn, *args).as_text()
    tm = pick_tm(m, e)
    assert re.search(rf"f32\[{num_items(m, e, tm)},{n},{tm}\][^\n]*custom-call", text)
    assert "grouped_matmul_mgpu_kernel" in text
    assert not re.search(r"\bdot\(", text)
    assert not re.search(r"\btranspose\(", text)


def test_gpu_check_case_judges_both_kernels(monkeypatch):
    """gpu_check's grouped matmul case (cases.GPU_CHECK_CASES) at its dry-run size: both
    kernels, bf16 weights and int8 codes, within the f32-summation bound of a float64 loop;
    and a Mosaic kernel that drops the int8 scales fails it."""
    import pallas_kernels.grouped_matmul_mgpu as mgpu
    from pallas_kernels.cases import GPU_CHECK_CASES
    check = GPU_CHECK_CASES["grouped_matmul"]
    r = check(interpret=True, small=True)
    assert r["within_tol"], r
    assert [(x["weights"], x["kernel"]) for x in r["rows"]] == [
        ("bf16", "triton"), ("bf16", "mosaic"), ("int8", "triton"), ("int8", "mosaic")]
    real = mgpu.grouped_matmul_mgpu
    monkeypatch.setattr(mgpu, "grouped_matmul_mgpu",
                        lambda x, w, gs, scales=None, **kw: real(
                            x, w, gs, None if scales is None else scales * 0 + 1, **kw))
    bad = check(interpret=True, small=True)
    assert not bad["within_tol"]
    assert [x["within_tol"] for x in bad["rows"]] == [True, True, True, False]
