"""GPTQ against an independent numpy implementation, and its defining property against RTN.

The reference is the plain OBS recursion GPTQ derives from (one row at a time, the inverse
Hessian shrunk explicitly after each row, no Cholesky, no lazy blocks, float64), with its own
quantizer formulas; the implementation under test uses the Cholesky rows and blocked updates.
"""

import numpy as np
import pytest

from jaxserve.quantization import QuantSpec, dequantize_codes, quantize
from jaxserve.quantization.gptq import GPTQConfig, gptq_kernel, hessian


def np_qparams(w, bits, symmetric):
    """Per-column (s, z) of rows w [g, N]: core.py's formulas, written again in numpy."""
    if symmetric:
        s = np.abs(w).max(0) / (2 ** (bits - 1) - 1)
        s = np.where(s == 0, 1.0, s)
        return s, np.zeros_like(s)
    lo, hi = w.min(0), w.max(0)
    s = (hi - lo) / (2 ** bits - 1)
    s = np.where(s == 0, 1.0, s)
    return s, np.round(-lo / s)


def np_quant(row, s, z, bits, symmetric):
    lo, hi = (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    q = np.clip(np.round(row / s) + z, lo, hi)
    return s * (q - z)


def np_gptq(w, h, bits, group, symmetric=False, act_order=False, damp=0.01):
    """Dequantized GPTQ result [K, N]; group=None: per output channel."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    k = w.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    g = group or k
    static = [np_qparams(w[i:i + g], bits, symmetric) for i in range(0, k, g)]
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    h = h + damp * np.mean(np.diag(h)) * np.eye(k)
    hinv = np.linalg.inv(h)
    remaining = list(range(k))
    out = np.zeros_like(w)
    params = None
    for r in order:
        if group is None or act_order:
            params = static[r // g]
        elif r % g == 0:
            params = np_qparams(w[r:r + g], bits, symmetric)
        out[r] = np_quant(w[r], *params, bits, symmetric)
        err = (w[r] - out[r]) / hinv[r, r]
        remaining.remove(r)
        rest = np.array(remaining, dtype=int)
        if rest.size:
            w[rest] -= np.outer(hinv[rest, r], err)
            hinv = hinv - np.outer(hinv[:, r], hinv[r, :]) / hinv[r, r]
    return out


def correlated_inputs(rng, m, k):
    """Inputs [M, K] with strongly correlated channels and uneven scales (like activations)."""
    mix = rng.normal(size=(k, k)) / np.sqrt(k) + np.eye(k)
    return (rng.normal(size=(m, k)) @ mix * rng.uniform(0.2, 3.0, size=k)).astype(np.float32)


def gptq_dequant(w, h, spec, **kw):
    q, s, z = gptq_kernel(w, h, spec, GPTQConfig(**kw))
    return np.asarray(dequantize_codes(q, s, z))


@pytest.mark.parametrize("bits,granularity,group,symmetric,act_order,block", [
    (4, "group", 32, False, False, 128),   # blocks hold 4 groups; params from updated rows
    (4, "group", 32, False, False, 32),    # one group per block
    (4, "group", 64, True, False, 64),
    (4, "group", 32, False, True, 64),     # act-order with static groups
    (8, "channel", None, False, False, 128),
    (8, "channel", None, True, True, 48),  # blocks not a power of two, act-order
])
def test_matches_numpy_reference(bits, granularity, group, symmetric, act_order, block):
    rng = np.random.default_rng(0)
    k, n = 128, 24
    x = correlated_inputs(rng, 512, k)
    w = rng.normal(size=(k, n)).astype(np.float32)
    h = hessian(x)
    spec = QuantSpec(bits, granularity, group or 128, symmetric)
    got = gptq_dequant(w, h, spec, act_order=act_order, block_size=block)
    want = np_gptq(w, h, bits, group, symmetric, act_order)
    # float32 (blocked, Cholesky) against float64 (recursion): the same roundings everywhere.
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_dead_inputs_are_zeroed():
    rng = np.random.default_rng(1)
    x = correlated_inputs(rng, 256, 64)
    x[:, 5] = 0.0  # an input channel that never fires
    w = rng.normal(size=(64, 8)).astype(np.float32)
    got = gptq_dequant(w, hessian(x), QuantSpec(4, "group", 32))
    np.testing.assert_allclose(got, np_gptq(w, hessian(x), 4, 32), atol=1e-4)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("spec", [QuantSpec(4, "group", 32), QuantSpec(4, "group", 64, True),
                                  QuantSpec(8, "channel"), QuantSpec(4, "tensor")])
@pytest.mark.parametrize("act_order", [False, True])
def test_output_error_below_rtn(spec, act_order):
    """GPTQ's objective ||XW - XW_hat|| on the calibration inputs is below round-to-nearest's."""
    rng = np.random.default_rng(2)
    x = correlated_inputs(rng, 1024, 128)
    w = rng.normal(size=(128, 64)).astype(np.float32)
    q, s, z = quantize(w, spec)
    rtn = np.linalg.norm(x @ w - x @ np.asarray(dequantize_codes(q, s, z)))
    gptq = np.linalg.norm(x @ w - x @ gptq_dequant(w, hessian(x), spec, act_order=act_order))
    assert gptq < 0.9 * rtn, (gptq, rtn)


# ---- the whole model, layer by layer --------------------------------------------------------

def _tiny():
    from models.config import ModelConfig
    from models.random_init import random_model
    return random_model(ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                    max_position_embeddings=256), seed=11)


def test_model_gptq_beats_rtn_on_calibration_logits():
    import dataclasses

    import jax

    from jaxserve.quantization import dequantize_weight
    from jaxserve.quantization.calibration import random_calibration
    from jaxserve.quantization.gptq import gptq_quantize
    from jaxserve.quantization.layerwise import LINEARS, rtn_params

    model = _tiny()
    spec = QuantSpec(4, "group", 32)
    calib = random_calibration(256, num_seqs=16, seq_len=64)

    def dequantized(params):
        layers = dict(params["layers"])
        for block, name in LINEARS:
            w = params["layers"][block][name]["kernel"]
            layers[block] = dict(layers[block])
            layers[block][name] = {"kernel": jax.vmap(dequantize_weight)(w)}
        return dataclasses.replace(model, params=dict(params, layers=layers))

    gptq = gptq_quantize(model, spec, calib, progress=False)
    assert gptq["layers"]["attn"]["q_proj"]["kernel"].packed.shape == (2, 64, 128)
    ids = calib.tokens[0]
    want = model.forward_logits(ids)
    err = {name: np.linalg.norm(dequantized(p).forward_logits(ids) - want)
           for name, p in (("gptq", gptq), ("rtn", rtn_params(model.params, spec)))}
    assert err["gptq"] < err["rtn"], err


def test_bfloat16_model_keeps_its_dtype():
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxserve.quantization.calibration import random_calibration
    from jaxserve.quantization.gptq import gptq_quantize

    model = _tiny()
    model = dataclasses.replace(model, dtype="bfloat16", params=jax.tree.map(
        lambda a: a.astype(jnp.bfloat16), model.params))
    params = gptq_quantize(model, QuantSpec(8, "channel", symmetric=True),
                           random_calibration(256, 4, 16), progress=False)
    assert params["layers"]["input_norm"]["scale"].dtype == jnp.bfloat16
    w = params["layers"]["mlp"]["down_proj"]["kernel"]
    assert w.q8.dtype == jnp.int8 and w.scales.dtype == jnp.float32
