"""The grouped matmul (pallas_kernels/grouped_matmul.py): the Pallas kernel (interpreted, and
compiled on a GPU: the `interpret` fixture), the tiled XLA path and the dense reference
against a float64 numpy per-group loop and `jax.lax.ragged_dot`; the tile schedule; the
sm_90a compile; the dots' shapes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import sort_by_expert
from pallas_kernels.grouped_matmul import (grouped_matmul, grouped_matmul_reference,
                                           grouped_matmul_tiled, num_items, pick_tm, schedule)
from tests import cuda_lowering

# f32: the same f32 products, summed in another order. bf16: bf16 inputs, exact products and
# f32 sums on every side (the result is f32, never rounded to bf16): the f32 bound holds too.
TOL = dict(rtol=2e-5, atol=2e-5)


def _routed_sizes(e: int, k: int, tokens: int, seed: int) -> list[int]:
    """Group sizes of `tokens` tokens routed to k of e experts (models/moe.py's sort)."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(e, size=k, replace=False) for _ in range(tokens)])
    _, sizes = sort_by_expert(jnp.asarray(experts, jnp.int32), e)
    return np.asarray(sizes).tolist()


# Group sizes: E in {1, 4, 8}; M = 1, tile multiples and not; empty groups, all rows in the
# first / last group, boundaries inside tiles; and routed top-k (k = 1, 2) batches.
SIZES = [[1], [37], [3, 0, 5, 0], [0, 0, 0, 16], [37, 0, 0, 0], [10, 7, 0, 20],
         [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0, 0],
         _routed_sizes(8, 2, 19, 1), _routed_sizes(8, 1, 9, 2), _routed_sizes(4, 2, 1, 3),
         [150, 0, 101, 49]]  # M = 300: the kernel's prefill-sized 64-row tiles


def _numpy_gmm(x, w, sizes, scales=None):
    """float64 per-group loop; rows past sum(sizes) are zeros."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    if scales is not None:  # int8 codes [E, N, K] with scales [E, N]
        w = np.swapaxes(w, 1, 2) * np.asarray(scales, np.float64)[:, None, :]
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, s in enumerate(sizes):
        out[start:start + s] = x[start:start + s] @ w[g]
        start += s
    return out


def _case(sizes, k, n, dtype, int8=False, seed=0, extra_rows=0):
    rng = np.random.default_rng(seed + 7 * len(sizes) + sum(sizes))
    e, m = len(sizes), max(sum(sizes) + extra_rows, 1)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    if int8:
        w = jnp.asarray(rng.integers(-127, 128, (e, n, k)), jnp.int8)
        scales = jnp.asarray(rng.uniform(0.5, 1.5, (e, n)) / (127 * np.sqrt(k)), jnp.float32)
    else:
        w, scales = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), dtype), None
    return x, w, jnp.asarray(sizes, jnp.int32), scales


def _check_all(got, x, w, sizes, scales):
    want = _numpy_gmm(x, w, sizes.tolist(), scales)
    np.testing.assert_allclose(np.asarray(got), want, **TOL)
    np.testing.assert_allclose(np.asarray(grouped_matmul_reference(x, w, sizes, scales)), want,
                               **TOL)
    if scales is None:  # ragged_dot, the independent oracle (float weights)
        oracle = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32,
                                    precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(got), np.asarray(oracle), **TOL)


@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("tm", [1, 4, 16])
def test_tiled_xla_matches_references(sizes, tm):
    x, w, gs, _ = _case(sizes, 24, 40, jnp.float32)
    _check_all(grouped_matmul_tiled(x, w, gs, tm=tm), x, w, gs, None)


@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_kernel_matches_references(sizes, interpret):
    x, w, gs, _ = _case(sizes, 32, 48, jnp.float32)
    _check_all(grouped_matmul(x, w, gs, interpret=interpret), x, w, gs, None)


@pytest.mark.parametrize("sizes", [[10, 7, 0, 20], _routed_sizes(8, 2, 19, 1)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_int8_and_bf16_match_references(sizes, dtype, interpret):
    """bf16 activations with float weights, and int8 codes with per-(group, channel) scales,
    through both paths (block_k 16 so the kernel's K loop runs twice)."""
    for int8 in (False, True):
        if dtype == jnp.float32 and not int8:
            continue  # the grid above
        x, w, gs, scales = _case(sizes, 32, 48, dtype, int8=int8)
        _check_all(grouped_matmul(x, w, gs, scales, block_k=16, interpret=interpret), x, w,
                   gs, scales)
        _check_all(grouped_matmul_tiled(x, w, gs, scales, tm=8), x, w, gs, scales)


def test_rows_in_no_group_are_zeros():
    """sum(sizes) < M: the rows past the groups are zeros, as ragged_dot's."""
    x, w, gs, _ = _case([2, 0, 3], 16, 16, jnp.float32, extra_rows=20)
    for got in (grouped_matmul(x, w, gs, interpret=True), grouped_matmul_tiled(x, w, gs, tm=4)):
        _check_all(got, x, w, gs, None)
        assert not np.asarray(got)[5:].any()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tm", [1, 3, 16])
def test_schedule_covers_every_tile_group_pair_once(seed, tm):
    """Valid items are exactly the (tile, group) pairs that share rows, each once, and fit in
    num_items (adversarial sizes: many groups starting inside tiles)."""
    rng = np.random.default_rng(seed)
    e = [1, 4, 8, 16, 32, 5][seed]
    sizes = rng.integers(0, 4, e) if seed % 2 else rng.integers(0, 40, e)
    m = max(int(sizes.sum()), 1)
    tile, group, valid, _, _ = (np.asarray(a) for a in schedule(jnp.asarray(sizes), m, tm))
    assert tile.shape == (num_items(m, e, tm),)
    got = sorted(zip(tile[valid == 1].tolist(), group[valid == 1].tolist()))
    ends = np.cumsum(sizes)
    want = sorted({(r // tm, int(np.searchsorted(ends, r, side="right")))
                   for r in range(int(sizes.sum()))})
    assert got == want
    assert (tile < -(-m // tm)).all() and (group < e).all()


def test_pick_tm_follows_the_mean_group():
    """With E: the mean rows of a group that has any, as a power of 2 in [16, 64] (64 experts
    at a batch-64 top-8 decode: 16, not 64); without (LoRA's slots): 16 up to 256 rows, 64
    above."""
    cases = {(1, 8): 16, (16, 8): 16, (128, 8): 16, (512, 8): 64, (512, 64): 16,
             (300, 4): 64, (100, 1): 64, (40, 2): 32}
    assert {c: pick_tm(*c) for c in cases} == cases
    assert (pick_tm(100), pick_tm(256), pick_tm(257)) == (16, 16, 64)


def test_kernel_refuses_shapes_triton_cannot_tile():
    x, w, gs, _ = _case([3, 5], 24, 40, jnp.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(x, w, gs, interpret=True)


def _dot_shapes(text: str) -> list[str]:
    """Operand types of every stablehlo.dot_general in lowered text."""
    return re.findall(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)",
                      text)


def test_tiled_dots_are_per_item_not_per_expert():
    """The tiled path's one dot is [I, tm, K] x [I, K, N] with I = num_items (22 for 64 rows
    in 8-row tiles over 16 experts), where ragged_dot's CPU lowering multiplies [E, M, K]."""
    m, e, k, n, tm = 64, 16, 32, 48, 8
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((e, k, n),
            jnp.float32), jax.ShapeDtypeStruct((e,), jnp.int32))
    items = num_items(m, e, tm)
    tiled = jax.jit(lambda *a: grouped_matmul_tiled(*a, tm=tm)).lower(*args).as_text()
    assert _dot_shapes(tiled) == [(f"tensor<{items}x{tm}x{k}xf32>",
                                   f"tensor<{items}x{k}x{n}xf32>")]
    ragged = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g)).lower(*args).as_text()
    assert (f"tensor<{e}x{m}x{k}xf32>", f"tensor<{e}x{k}x{n}xf32>") in _dot_shapes(ragged)


def _h200_args(m, e, k, n, dtype, int8=False):
    s = jax.ShapeDtypeStruct
    if int8:
        return [s((m, k), dtype), s((e, n, k), jnp.int8), s((e,), jnp.int32),
                s((e, n), jnp.float32)]
    return [s((m, k), dtype), s((e, k, n), dtype), s((e,), jnp.int32)]


@pytest.mark.parametrize("m,dtype,int8", [(1, jnp.float32, False), (16, jnp.bfloat16, True),
                                          (512, jnp.bfloat16, False)])
def test_kernel_compiles_for_h200(m, dtype, int8):
    """sm_90a compile (decode-sized f32, int8 codes, prefill-sized 64-row tiles): the
    Triton kernel is one custom call over [num_items, tm, N], and the only dots left to XLA
    are none (routing is not part of this function)."""
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    e, k, n = 8, 128, 256
    compiled = cuda_lowering.compile_for_h200(lambda *a: grouped_matmul(*a),
                                              *_h200_args(m, e, k, n, dtype, int8))
    text = compiled.as_text()
    tm = 16 if m <= 256 else 64
    assert re.search(rf"f32\[{num_items(m, e, tm)},{tm},{n}\][^\n]*custom-call", text)
    assert not re.search(r"\bdot\(", text)
