"""The defining properties of affine/symmetric quantization (core.py), checked against numpy."""

import numpy as np
import pytest

from jaxserve.quantization import (QuantSpec, compute_qparams, dequantize_codes,
                                   dequantize_weight, quantize, quantize_with, to_weight)

BITS = (4, 8)


def np_affine(w, bits, g):
    """Independent numpy version of the affine formulas (quantization/core.py's docstring), per group of g rows."""
    k, n = w.shape
    wg = w.astype(np.float64).reshape(k // g, g, n)
    r_min, r_max = wg.min(axis=1), wg.max(axis=1)  # [K/g, N]
    s = (r_max - r_min) / (2 ** bits - 1)
    z = np.round(-r_min / s)
    q = np.clip(np.round(wg / s[:, None]) + z[:, None], 0, 2 ** bits - 1)
    return (s[:, None] * (q - z[:, None])).reshape(k, n), s


def roundtrip(w, spec):
    q, s, z = quantize(w, spec)
    return np.asarray(dequantize_codes(q, s, z)), np.asarray(s), np.asarray(z), np.asarray(q)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("granularity,g", [("tensor", 256), ("channel", 256), ("group", 32),
                                           ("group", 128)])
def test_affine_matches_numpy_formulas(bits, granularity, g):
    w = np.random.default_rng(bits).normal(size=(256, 48)).astype(np.float32)
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=g if g < 256 else 128)
    r_hat, s, _, q = roundtrip(w, spec)
    if granularity == "tensor":
        ref, s_ref = np_affine(w.reshape(-1, 1), bits, w.size)
        ref = ref.reshape(w.shape)
        np.testing.assert_allclose(s, np.broadcast_to(s_ref, s.shape), rtol=1e-6)
    else:
        ref, s_ref = np_affine(w, bits, g)
        np.testing.assert_allclose(s, s_ref, rtol=1e-6)
    assert q.min() >= 0 and q.max() <= 2 ** bits - 1
    # One code step apart at most, where float32 vs float64 rounding lands on the other side.
    np.testing.assert_allclose(r_hat, ref, atol=1.001 * s.max())
    assert np.mean(np.isclose(r_hat, ref, atol=1e-5, rtol=1e-5)) > 0.999


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_error_at_most_half_step_inside_range(bits, symmetric):
    w = np.random.default_rng(1).uniform(-3, 2, size=(128, 64)).astype(np.float32)
    spec = QuantSpec(bits=bits, granularity="group", group_size=32, symmetric=symmetric)
    r_hat, s, _, _ = roundtrip(w, spec)
    step = np.repeat(s, 32, axis=0)  # [K, N]
    assert np.all(np.abs(r_hat - w) <= step / 2 * (1 + 1e-5))
    # RTN lands inside the half step, not at an arbitrary point: it is not trivially satisfied.
    assert np.max(np.abs(r_hat - w) / step) > 0.45


@pytest.mark.parametrize("bits", BITS)
def test_error_exactly_half_step_at_midpoint(bits):
    # Range [-2^(b-1), 2^(b-1) - 1] / 16 gives s = 1/16 and z = 2^(b-1) exactly (powers of 2).
    levels = 2 ** bits
    lo, hi = -levels / 2 / 16, (levels / 2 - 1) / 16
    base = np.full((32, 1), lo, np.float32)
    base[1] = hi
    spec = QuantSpec(bits=bits, granularity="channel")
    s, z = compute_qparams(base, spec)
    assert float(s[0, 0]) == 1 / 16 and float(z[0, 0]) == levels / 2
    mid = ((np.arange(32) % (levels - 1)) - levels / 2 + 0.5)[:, None] / 16  # halfway points
    mid = mid.astype(np.float32)
    q = quantize_with(mid, s, z, spec)
    err = np.abs(np.asarray(dequantize_codes(q, s, z)) - mid)
    np.testing.assert_array_equal(err, np.full_like(err, 1 / 32))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_values_beyond_the_range_saturate(bits, symmetric):
    rng = np.random.default_rng(2)
    base = rng.uniform(-1.0, 0.5, size=(64, 8)).astype(np.float32)
    spec = QuantSpec(bits=bits, granularity="channel", symmetric=symmetric)
    s, z = compute_qparams(base, spec)
    s_, z_ = np.asarray(s)[0], np.asarray(z)[0]
    top, bottom = s_ * (spec.qmax - z_), s_ * (spec.qmin - z_)  # the extreme codes' values
    far = np.concatenate([base.max(axis=0, keepdims=True) + 10.0,
                          base.min(axis=0, keepdims=True) - 10.0] * 16)  # [32, 8] alternating
    far = np.concatenate([far, base[:32]])  # [64, 8]: the qparams' group is all 64 rows
    r_hat = np.asarray(dequantize_codes(quantize_with(far, s, z, spec), s, z))
    np.testing.assert_array_equal(r_hat[0:32:2], np.broadcast_to(top, (16, 8)))
    np.testing.assert_array_equal(r_hat[1:32:2], np.broadcast_to(bottom, (16, 8)))
    # The ends reconstruct to r_max / r_min themselves (within rounding of s and z).
    rmax, rmin = base.max(axis=0), base.min(axis=0)
    if symmetric:
        rmax = np.abs(base).max(axis=0)
        rmin = -rmax
    assert np.all(np.abs(top - rmax) <= s_ / 2 + 1e-6)
    assert np.all(np.abs(bottom - rmin) <= s_ / 2 + 1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_step_is_17x_int8_step(symmetric):
    w = np.random.default_rng(3).normal(size=(128, 16)).astype(np.float32)
    s4, _ = compute_qparams(w, QuantSpec(bits=4, granularity="channel", symmetric=symmetric))
    s8, _ = compute_qparams(w, QuantSpec(bits=8, granularity="channel", symmetric=symmetric))
    ratio = 255 / 15 if not symmetric else 127 / 7
    np.testing.assert_allclose(np.asarray(s4) / np.asarray(s8), ratio, rtol=1e-6)
    if not symmetric:
        assert ratio == 17


@pytest.mark.parametrize("bits", BITS)
def test_finer_granularity_has_smaller_error_with_outliers(bits):
    rng = np.random.default_rng(4)
    w = rng.normal(scale=0.02, size=(512, 64)).astype(np.float32)
    w[rng.integers(0, 512, 6), rng.integers(0, 64, 6)] = 1.5  # a few large outliers
    w[:, 7] *= 20  # and one loud output channel
    errs = {}
    for name, spec in [("tensor", QuantSpec(bits=bits, granularity="tensor")),
                       ("channel", QuantSpec(bits=bits, granularity="channel")),
                       ("group", QuantSpec(bits=bits, granularity="group", group_size=32))]:
        r_hat, *_ = roundtrip(w, spec)
        errs[name] = float(np.mean((r_hat - w) ** 2))
    assert errs["group"] < errs["channel"] < errs["tensor"], errs


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_loses_nothing_on_zero_centred_data(bits):
    # Each column symmetric about 0 (pairs +-v): the symmetric range equals the affine one.
    rng = np.random.default_rng(5)
    half = rng.normal(size=(2048, 32)).astype(np.float32)
    w = np.concatenate([half, -half])  # [4096, 32]
    sym, s_sym, *_ = roundtrip(w, QuantSpec(bits=bits, granularity="channel", symmetric=True))
    asym, s_asym, *_ = roundtrip(w, QuantSpec(bits=bits, granularity="channel"))
    err_sym, err_asym = np.mean((sym - w) ** 2), np.mean((asym - w) ** 2)
    # Symmetric has one level fewer (2^b - 1 vs 2^b over the same range): its step is larger by
    # (2^b - 1)/(2^b - 2), nothing more; and zero is exact, which affine cannot promise.
    levels = 2 ** bits - 1
    np.testing.assert_allclose(np.asarray(s_sym) / np.asarray(s_asym), levels / (levels - 1),
                               rtol=1e-5)
    # Rounding error is ~uniform on [-s/2, s/2], so MSE scales with s^2 (2% sampling noise).
    assert err_sym <= err_asym * (levels / (levels - 1)) ** 2 * 1.02
    zero = np.zeros((128, 1), np.float32)
    zero[0], zero[1] = 1.0, -1.0
    z_hat, *_ = roundtrip(zero, QuantSpec(bits=bits, granularity="channel", symmetric=True))
    assert np.all(z_hat[2:] == 0)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("granularity", ["channel", "group", "tensor"])
def test_weight_pytree_round_trip(bits, symmetric, granularity):
    w = np.random.default_rng(6).normal(size=(256, 40)).astype(np.float32)
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=64, symmetric=symmetric)
    q, s, z = quantize(w, spec)
    if bits == 4 and granularity != "group":
        with pytest.raises(ValueError, match="per group"):
            to_weight(q, s, z, spec)
        return
    pytree = to_weight(q, s, z, spec)
    expected_keys = {"packed" if bits == 4 else "q8", "scales"} | (
        set() if symmetric else {"offsets"})
    assert set(pytree.arrays()) == expected_keys
    code = pytree.packed if bits == 4 else pytree.q8
    assert code.dtype == (np.uint8 if bits == 4 else np.int8)
    assert code.shape == ((128, 40) if bits == 4 else (40, 256))  # int8: output-major
    np.testing.assert_allclose(np.asarray(dequantize_weight(pytree)),
                               np.asarray(dequantize_codes(q, s, z)), rtol=1e-6, atol=1e-6)


def test_spec_validation_messages():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        QuantSpec(bits=3)
    with pytest.raises(ValueError, match="granularity"):
        QuantSpec(granularity="row")
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec(group_size=48)
    with pytest.raises(ValueError, match="does not divide"):
        quantize(np.zeros((96, 4), np.float32), QuantSpec(group_size=64))
