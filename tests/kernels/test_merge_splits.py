"""The combine of a split attention's partials (pallas_kernels/merge_splits.py): the kernel
(interpreted, and compiled on a GPU: the `interpret` fixture) against its jax.numpy reference
and both against float64 numpy; empty splits and rows past a tile; the CUDA lowering and the
sm_90a compile (registers, no spills).

Partials are what the attention kernel leaves: each split's output normalised by its own sum,
its running max and sum (a split that saw no page: max at the mask value, sum 0).
Tolerances: f32 1e-5 (the same f32 math in another order); bf16 output: the f32 result rounded
once, so 2^-8 relative plus the f32 bound.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_tiling import MASK_VALUE
from pallas_kernels.merge_splits import merge_splits, merge_splits_reference
from tests import cuda_lowering

F32, BF16 = jnp.float32, jnp.bfloat16


def _partials(seed, splits, rows, head_dim, empty=()):
    """o [S, N, Dh], m, l [S, N] float32; the splits in `empty` saw nothing."""
    rng = np.random.default_rng(seed)
    o = rng.normal(size=(splits, rows, head_dim)).astype(np.float32)
    m = rng.normal(size=(splits, rows)).astype(np.float32) * 4
    l = rng.uniform(0.5, 30, size=(splits, rows)).astype(np.float32)
    for s in empty:
        o[s], m[s], l[s] = 0.0, MASK_VALUE, 0.0
    return o, m, l


def _numpy_merge(o, m, l):
    o, m, l = (np.asarray(a, np.float64) for a in (o, m, l))
    w = l * np.exp(m - m.max(axis=0))
    return (o * w[..., None]).sum(axis=0) / w.sum(axis=0)[..., None]


@pytest.mark.parametrize("splits,rows,head_dim,empty,dtype", [
    (2, 32, 128, (), BF16),        # 8B at batch 1: 32 heads
    (16, 9, 64, (3, 15), F32),     # SmolLM2's 9 heads; empty splits; rows short of a tile
    (5, 40, 64, (0,), BF16),       # rows past two tiles; the first split empty
    (16, 128, 128, (), F32),
])
def test_kernel_matches_reference_and_numpy(splits, rows, head_dim, empty, dtype, interpret):
    o, m, l = _partials(splits + rows, splits, rows, head_dim, empty)
    got = merge_splits(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), out_dtype=dtype,
                       interpret=interpret)
    assert got.shape == (rows, head_dim) and got.dtype == dtype
    want = _numpy_merge(o, m, l)
    rel = 1e-5 + (2.0 ** -8 if dtype == BF16 else 0.0)
    got64 = np.asarray(np.asarray(got, np.float32), np.float64)
    np.testing.assert_allclose(got64, want, rtol=rel, atol=1e-5)
    ref = merge_splits_reference(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l))
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=1e-5, atol=1e-5)


def test_one_split_of_mass_gives_its_output():
    """All the mass in one split (the others empty): the output is that split's (w * o / w:
    two f32 roundings)."""
    o, m, l = _partials(7, 4, 16, 64, empty=(0, 1, 3))
    got = merge_splits(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), out_dtype=F32,
                       interpret=True)
    np.testing.assert_allclose(np.asarray(got), o[2], rtol=2.0 ** -22, atol=0)


def test_bad_shapes_are_refused():
    o = jnp.zeros((2, 8, 96), F32)
    with pytest.raises(ValueError, match="power of 2"):
        merge_splits(o, jnp.zeros((2, 8)), jnp.zeros((2, 8)), out_dtype=F32, interpret=True)
    with pytest.raises(ValueError, match="m, l"):
        merge_splits(jnp.zeros((2, 8, 64)), jnp.zeros((3, 8)), jnp.zeros((2, 8)),
                     out_dtype=F32, interpret=True)


def _h200_args(splits, rows, head_dim):
    sd = jax.ShapeDtypeStruct
    return sd((splits, rows, head_dim), F32), sd((splits, rows), F32), sd((splits, rows), F32)


def test_kernel_lowers_for_cuda():
    """The 8B's batch-1 combine (16 splits, 32 heads of 128) lowers to one Triton call over
    two 16-row programs, and nothing of the combine is left to XLA."""
    text = cuda_lowering.lower_for_h200(
        lambda o, m, l: merge_splits(o, m, l, out_dtype=BF16), *_h200_args(16, 32, 128))
    calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton.*", text)
    assert len(calls) == 1 and 'name = "merge_splits"' in calls[0]
    assert "grid_x = 2 : i32, grid_y = 1 : i32" in calls[0]
    assert not re.search(r"stablehlo\.(reduce|exponential|divide|convert)\b", text)


@pytest.mark.parametrize("splits,rows,head_dim", [(16, 32, 128), (16, 9, 64), (2, 64, 128)])
def test_kernel_compiles_for_h200_without_spills(splits, rows, head_dim, tmp_path):
    from jaxserve.tools import compiled_report, deviceless
    why = deviceless.unavailable_reason()
    if why:
        pytest.skip(why)
    out = deviceless.compile_for_h200(lambda o, m, l: merge_splits(o, m, l, out_dtype=BF16),
                                      list(_h200_args(splits, rows, head_dim)),
                                      dump_dir=tmp_path)
    if out.ptxas_note:
        pytest.skip(f"no ptxas report: {out.ptxas_note}")
    kernel = compiled_report.ptxas_kernels(out.ptxas_log)["merge_splits"]
    assert kernel["registers"] <= 255 and kernel["spill_bytes"] == 0, kernel
