"""Mosaic GPU int4 (W4A16) matmul: kernel vs `int4_matmul_reference` in the GPU interpreter with
race detection (the detector prints "RACE DETECTED" to stdout: every run asserts it is absent),
refused shapes, and deviceless sm_90a lowering and compiles of the engine's shapes.

Tolerances: pallas_kernels/cases.py INT4_TOLERANCE, as for the Triton kernel. Grid: every
(K, N) x group size x {symmetric, asymmetric} at M = 16 in bf16 with bf16 scales (the shapes
differ from the Triton grid's); every M in {1, 7, 16, 64} x symmetry at one shape; f16
activations once; M = 70 (two M blocks) once; 4 K tiles in one split. K % 128 == 64 (a
half-tile tail, one split of its own): SmolLM2's three K = 576 GEMMs x g in {32, 64} x M in
{1 (symmetric), 16 (asymmetric)}, and the tail beside a split of 4 tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.cases import (INT4_MODEL_SHAPES, int4_activations, int4_error_bound,
                                  int4_group_size, int4_weights)
from pallas_kernels.int4_matmul import int4_matmul_reference
from pallas_kernels.int4_matmul_mgpu import cost, int4_matmul_mgpu, pick_split, unsupported
from tests import cuda_lowering
from tests.cuda_lowering import lower_for_h200

RACES = plgpu.InterpretGPUParams(detect_races=True)
SHAPES = [(256, 512), (512, 128), (1536, 64)]
GROUPS = [32, 64, 128]
SHAPE_GRID = [(k, n, g) for k, n in SHAPES for g in GROUPS]
TAIL_GRID = [(k, n, g) for k, n in [(576, 576), (576, 192), (576, 1536)] for g in (32, 64)]


def _run(capfd, m, k, n, g, symmetric, dtype=jnp.bfloat16, **blocks):
    packed, scales, offsets = int4_weights(k, n, g, symmetric, scale_dtype=jnp.bfloat16)
    x = int4_activations(m, k, dtype)
    y = int4_matmul_mgpu(x, packed, scales, offsets, group_size=g, interpret=RACES, **blocks)
    y = np.asarray(y.astype(jnp.float32))
    assert "RACE DETECTED" not in capfd.readouterr().out
    ref = np.asarray(int4_matmul_reference(x.astype(jnp.float32), packed, scales, offsets,
                                           group_size=g))
    assert y.shape == ref.shape == (m, n)
    np.testing.assert_array_less(np.abs(y - ref), _bound(ref, dtype))


def _bound(ref, dtype):
    """cases.py's bound; f16 (not in INT4_TOLERANCE) by the same argument: exact-input dot, f32
    sums, one rounding of the output to f16 (2^-11 relative), so 2^-10 |ref| + 1e-5 scale."""
    if jnp.dtype(dtype) == jnp.float16:
        return 2.0 ** -10 * np.abs(ref) + 1e-5 * np.max(np.abs(ref))
    return int4_error_bound(ref, dtype)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,n,g", SHAPE_GRID)
def test_matches_reference_shapes(k, n, g, symmetric, capfd):
    _run(capfd, 16, k, n, g, symmetric)


@pytest.mark.parametrize("m,symmetric", [(1, True), (16, False)])
@pytest.mark.parametrize("k,n,g", TAIL_GRID)
def test_matches_reference_k_tail(m, k, n, g, symmetric, capfd):
    """SmolLM2's d_model: 4 full K tiles in 4 splits, and the last 64 rows as a fifth."""
    _run(capfd, m, k, n, g, symmetric)


def test_multi_tile_splits_and_k_tail(capfd):
    """The grids above give every split 1 or 2 K tiles; from 3 the pipeline refills a slot read
    two steps before (a race if a read of it is not fenced), so 4 tiles in one split, with and
    without the tail beside it."""
    _run(capfd, 5, 512, 64, 32, True, split_k=1)
    _run(capfd, 5, 576, 64, 32, False, split_k=1)
    _run(capfd, 3, 192, 64, 64, True)  # one full tile: the tail re-reads all of its second half


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m", [1, 7, 16, 64])
def test_matches_reference_m(m, symmetric, capfd):
    _run(capfd, m, 512, 128, 64, symmetric)


def test_f16_activations_and_two_m_blocks(capfd):
    _run(capfd, 5, 256, 64, 128, False, dtype=jnp.float16)
    _run(capfd, 70, 256, 64, 64, True)  # block_m 64: rows 64..69 in a second, padded block
    _run(capfd, 20, 256, 64, 32, False, block_m=8)  # three M blocks of 8


def test_race_detector_catches_a_racy_kernel(capfd):
    """Reading SMEM before waiting on the TMA's barrier is flagged: the check above can fail."""
    def racy(x_ref, o_ref, x_smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[0])
        x_smem[...] = x_smem[...] + 1.0  # no barrier_wait before the read
        plgpu.barrier_wait(bar.at[0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    x = jnp.ones((128, 128), jnp.float32)  # [128, 128]
    plgpu.kernel(racy, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                 scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_barriers=1)],
                 interpret=RACES)(x).block_until_ready()
    assert "RACE DETECTED" in capfd.readouterr().out


@pytest.mark.parametrize("m,k,n,g,dtype,match", [
    (1, 576, 1536, 128, jnp.bfloat16, "multiple of group_size"),
    (1, 608, 128, 32, jnp.bfloat16, "K=608 must be a multiple of 64"),
    (1, 64, 128, 32, jnp.bfloat16, "at least 128"),  # no full tile for the tail to end
    (1, 512, 96, 64, jnp.bfloat16, "N=96 must be a multiple of 64"),
    (1, 512, 128, 16, jnp.bfloat16, "group_size"),
    (1, 512, 128, 64, jnp.float32, "bfloat16 or float16"),
])
def test_refused_shapes_raise(m, k, n, g, dtype, match):
    assert match in unsupported(m, k, n, g, dtype)
    packed, scales, offsets = int4_weights(k, n, g if k % g == 0 else 32, False)
    with pytest.raises(ValueError, match=match):
        int4_matmul_mgpu(int4_activations(m, k, dtype), packed, scales, offsets, group_size=g)


def test_invalid_arguments_raise():
    packed, scales, offsets = int4_weights(512, 128, 64, False)
    x = int4_activations(3, 512, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_n"):
        int4_matmul_mgpu(x, packed, scales, offsets, group_size=64, block_n=128)
    with pytest.raises(ValueError, match="block_m"):
        int4_matmul_mgpu(x, packed, scales, offsets, group_size=64, block_m=12)
    with pytest.raises(ValueError, match="scales"):
        int4_matmul_mgpu(x, packed, scales[:4], offsets, group_size=64)
    with pytest.raises(ValueError, match="packed"):
        int4_matmul_mgpu(x, packed[:128], scales, offsets, group_size=64)
    with pytest.raises(ValueError, match="split_k"):
        int4_matmul_mgpu(x, packed, scales, offsets, group_size=64, split_k=3)  # of 4 tiles


ENGINE_SHAPES = [kn for model in ("smollm2", "llama3_8b") for kn in INT4_MODEL_SHAPES[model]]
SUPPORTED = [(k, n) for k, n in ENGINE_SHAPES
             if unsupported(1, k, n, int4_group_size(k), jnp.bfloat16) is None]


def test_engine_shapes_all_supported():
    """SmolLM2's K = 576 GEMMs included (a half-tile tail), at the engine's group size."""
    assert SUPPORTED == ENGINE_SHAPES


@pytest.mark.parametrize("n", [192, 576, 1536])
def test_smollm2_k_tail_split_and_cost(n):
    """K = 576: the 4 full tiles split 4 ways (too few blocks for 132 programs) and the tail
    is a fifth split; the cost counts its partials written and read, not its L2 re-read."""
    assert pick_split(1, 576, n) == 4
    c = cost(1, 576, n, 64)
    assert c["flops"] == 2 * 576 * n and c["launches"] == 3
    weights = 576 * n // 2 + 2 * 2 * 9 * n        # packed, bf16 scales and offsets [9, N]
    partials = 2 * 4 * 5 * n * 8                  # [5, N, 8] f32, written then read
    x = 2 * 576 + 2 * (2 * 8 * 576 + 4 * 9 * 8)   # x read; padded x and sums written, read
    assert c["bytes"] == weights + partials + x + 2 * n  # + the [1, N] bf16 output


@pytest.mark.parametrize("k,n", INT4_MODEL_SHAPES["llama3_8b"])
def test_8b_decode_fills_an_h200(k, n):
    """>= 132 programs (one per SM) at decode, by split-K where N has few 64-column blocks."""
    for m in (1, 16, 64):
        assert (n // 64) * pick_split(m, k, n) >= 132
    c = cost(1, k, n, 128)
    assert c["flops"] == 2 * k * n and c["launches"] == 3
    # Packed weights, then bf16 scales and offsets (1/16 of them at g = 128), split partials.
    assert k * n // 2 < c["bytes"] < 1.25 * k * n // 2


def _fn(g):
    return lambda x, p, s, o: int4_matmul_mgpu(x, p, s, o, group_size=g)


def _args(m, k, n, g):
    s = jax.ShapeDtypeStruct
    return [s((m, k), jnp.bfloat16), s((k // 2, n), jnp.uint8),
            s((k // g, n), jnp.bfloat16), s((k // g, n), jnp.bfloat16)]  # the GPU format


CUDA_CASES = [(m, k, n) for k, n in SUPPORTED for m in (1, 16, 64)]


@pytest.mark.parametrize("m,k,n", CUDA_CASES)
def test_lowers_for_h200(m, k, n):
    g = int4_group_size(k)
    assert "mosaic_gpu" in lower_for_h200(_fn(g), *_args(m, k, n, g))


@pytest.mark.parametrize("m,k,n", CUDA_CASES)
def test_compiles_for_h200(m, k, n):
    """Full sm_90a compile (catches shared-memory overflow); needs jax-cuda13-plugin."""
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    g = int4_group_size(k)
    cuda_lowering.compile_for_h200(_fn(g), *_args(m, k, n, g))
