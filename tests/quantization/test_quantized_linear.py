"""Matmuls on quantized weight pytrees against numpy (float64) on the dequantized weight."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quantization import QuantSpec, dequantize_weight, quantize, to_weight
from jaxserve.quantization.linear import quantized_linear

K, N = 256, 48


def make(bits, granularity, symmetric, seed=0):
    w = np.random.default_rng(seed).normal(scale=0.05, size=(K, N)).astype(np.float32)
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=64, symmetric=symmetric)
    tree = to_weight(*quantize(w, spec), spec)
    return tree, np.asarray(dequantize_weight(tree), np.float64)  # [K, N]


def acts(m, seed=1):
    x = np.random.default_rng(seed).normal(size=(m, K)).astype(np.float32)
    x[:, 3] *= 30  # an outlier channel, as LLM activations have
    return x


CASES = [(8, "channel", True), (8, "channel", False), (8, "group", True), (8, "group", False),
         (4, "group", True), (4, "group", False)]


@pytest.mark.parametrize("bits,granularity,symmetric", CASES)
@pytest.mark.parametrize("m", [1, 5])
def test_exact_paths_equal_dequantized_matmul(bits, granularity, symmetric, m):
    tree, w = make(bits, granularity, symmetric)
    x = acts(m)
    y = np.asarray(quantized_linear(jnp.asarray(x), tree, limbs=False))
    ref = x.astype(np.float64) @ w
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 3])
def test_w8a16_limbs_within_16bit_fixed_point_bound(symmetric, m):
    tree, w = make(8, "channel", symmetric)
    x = acts(m)
    y = np.asarray(quantized_linear(jnp.asarray(x), tree, limbs=True))
    ref = x.astype(np.float64) @ w
    # |x - x_hat| <= max|x[m]| / 508 / 127 elementwise, so |y - ref| <= that * sum_k |w[k, n]|.
    bound = np.abs(x).max(axis=1, keepdims=True) / (508 * 127) * np.abs(w).sum(axis=0)
    err = np.abs(y - ref)
    assert np.all(err <= bound * 1.01 + 1e-5 * np.abs(ref).max())
    # ...and far below what int8 activations (W8A8) lose on the same product.
    y8 = np.asarray(quantized_linear(jnp.asarray(x), tree, activation_bits=8))
    assert err.max() * 20 < np.abs(y8 - ref).max()


@pytest.mark.parametrize("symmetric", [True, False])
def test_w8a8_matches_numpy_per_token_int8(symmetric):
    tree, w = make(8, "channel", symmetric)
    x = acts(4)
    y = np.asarray(quantized_linear(jnp.asarray(x), tree, activation_bits=8))
    x64 = x.astype(np.float64)
    sx = np.abs(x64).max(axis=1, keepdims=True) / 127
    xq = np.clip(np.round(x64 / sx), -127, 127)
    ref = (xq * sx) @ w  # int8 activations times the dequantized weight
    if not symmetric:  # the offsets' term uses the float activations' row sums
        b = np.asarray(tree.offsets, np.float64)  # [1, N]
        ref += x64.sum(axis=1, keepdims=True) * b - (xq * sx).sum(axis=1, keepdims=True) * b
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = x64 @ w
    assert np.abs(y - exact).max() > 1e-4 * np.abs(exact).max()  # activations really are int8


def test_single_row_equals_its_row_in_a_batch():
    tree, _ = make(8, "channel", True)
    x = acts(4)
    for bits in (8, 16):
        batch = np.asarray(quantized_linear(jnp.asarray(x), tree, activation_bits=bits))
        one = np.asarray(quantized_linear(jnp.asarray(x[2:3]), tree, activation_bits=bits))
        np.testing.assert_allclose(one[0], batch[2], rtol=1e-6, atol=1e-6)


def test_w8a8_refuses_per_group_weights():
    x = jnp.asarray(acts(2))
    with pytest.raises(ValueError, match="per-channel"):
        quantized_linear(x, make(8, "group", True)[0], activation_bits=8)


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a8_xla_matches_numpy_per_token_int8(symmetric):
    """W4A8 (int4 weights, int8 activations per token) in XLA, the native CPU kernel's math:
    the symmetric part s (u - 8) meets the int8 activations, offsets + 8 s the float sums."""
    tree, w = make(4, "group", symmetric)
    x = acts(3)
    y = np.asarray(quantized_linear(jnp.asarray(x), tree, activation_bits=8))
    x64 = x.astype(np.float64)
    sx = np.abs(x64).max(axis=1, keepdims=True) / 127
    xh = np.clip(np.round(x64 / sx), -127, 127) * sx
    s = np.repeat(np.asarray(tree.scales, np.float64), 64, axis=0)  # [K, N]
    ref = xh @ w
    if not symmetric:  # w = s (u - 8) + (b + 8 s): the second part against the float sums
        bias = np.repeat(np.asarray(tree.offsets, np.float64), 64, axis=0) + 8 * s
        ref = xh @ (w - bias) + x64 @ bias
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = x64 @ w
    assert np.abs(y - exact).max() > 1e-4 * np.abs(exact).max()  # activations really are int8
