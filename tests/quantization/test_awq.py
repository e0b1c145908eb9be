"""AWQ: folding the scales is exact in float, and the scaled rounding beats RTN where it should."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quantization import QuantSpec, dequantize_codes, dequantize_weight, quantize
from jaxserve.quantization.awq import awq_quantize, awq_scale, fold_scales, search_scale
from jaxserve.quantization.calibration import random_calibration
from jaxserve.quantization.layerwise import LINEARS, layer_slice, replace_kernels
from models.config import ModelConfig
from models.random_init import random_model

# GQA with 2 query heads per KV head, so the o_proj scales must be tied to be exact.
TINY = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny():
    return random_model(TINY, seed=3)


def random_scales(rng, c: ModelConfig):
    kv = rng.uniform(0.3, 3.0, size=(c.num_kv_heads, 1, c.head_dim))
    o = np.broadcast_to(kv, (c.num_kv_heads, c.queries_per_kv, c.head_dim)).reshape(-1)
    return {"q_proj": jnp.asarray(rng.uniform(0.3, 3.0, c.hidden_size), jnp.float32),
            "o_proj": jnp.asarray(o, jnp.float32),
            "gate_proj": jnp.asarray(rng.uniform(0.3, 3.0, c.hidden_size), jnp.float32),
            "down_proj": jnp.asarray(rng.uniform(0.3, 3.0, c.intermediate_size), jnp.float32)}


@pytest.mark.parametrize("bias", [False, True])
def test_folding_random_scales_is_exact(bias):
    config = dataclasses.replace(TINY, attention_bias=bias, architecture="qwen2" if bias
                                 else "llama")
    model = random_model(config, seed=4)
    if bias:  # flax initialises biases to zero: make them matter
        rng0 = np.random.default_rng(9)
        model = dataclasses.replace(model, params=jax.tree_util.tree_map_with_path(
            lambda p, a: a + rng0.normal(size=a.shape).astype(np.float32)
            if "bias" in jax.tree_util.keystr(p) else a, model.params))
    rng = np.random.default_rng(5)
    layers = [fold_scales(layer_slice(model.params, i), config, random_scales(rng, config))
              for i in range(config.num_layers)]
    folded = dataclasses.replace(model, params=replace_kernels(model.params, layers))
    ids = np.random.default_rng(6).integers(0, config.vocab_size, 40)
    want, got = model.forward_logits(ids), folded.forward_logits(ids)
    # Changed: every linear and norm of the layers (a no-op fold would not test anything).
    assert not np.allclose(np.asarray(layers[0]["attn"]["v_proj"]["kernel"]),
                           np.asarray(model.params["layers"]["attn"]["v_proj"]["kernel"][0]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_awq_folded_model_is_the_float_model(tiny):
    folded, alphas = awq_scale(tiny, QuantSpec(4, "group", 32), random_calibration(256),
                               progress=False)
    ids = np.random.default_rng(7).integers(0, 256, 33)
    want = tiny.forward_logits(ids)
    got = dataclasses.replace(tiny, params=folded).forward_logits(ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert len(alphas) == 4 * TINY.num_layers


def salient_inputs(rng, m, k, n_salient=4):
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[:, :n_salient] *= 30.0  # a few outlier channels, as in LLM activations
    return x


@pytest.mark.parametrize("spec", [QuantSpec(4, "group", 32), QuantSpec(4, "channel"),
                                  QuantSpec(8, "channel", symmetric=True)])
def test_awq_error_below_rtn_with_salient_channels(spec):
    rng = np.random.default_rng(8)
    x = salient_inputs(rng, 512, 128)
    w = rng.normal(size=(128, 96)).astype(np.float32)
    s, alpha, losses = search_scale(x, [jnp.asarray(w)], spec)
    s = np.asarray(s)
    q, sc, z = quantize(w * s[:, None], spec)
    awq = np.linalg.norm(x @ w - (x / s) @ np.asarray(dequantize_codes(q, sc, z)))
    q, sc, z = quantize(w, spec)
    rtn = np.linalg.norm(x @ w - x @ np.asarray(dequantize_codes(q, sc, z)))
    assert alpha > 0 and awq < 0.8 * rtn, (alpha, awq, rtn)
    # The search reports the same objective: its alpha = 0 entry is RTN's squared error.
    np.testing.assert_allclose(losses[0.0], rtn ** 2 / x.shape[0], rtol=1e-3)


def test_awq_quantize_pytrees(tiny):
    params = awq_quantize(tiny, QuantSpec(4, "group", 32), random_calibration(256),
                          progress=False)
    for block, name in LINEARS:
        w = params["layers"][block][name]["kernel"]
        k, n = tiny.params["layers"][block][name]["kernel"].shape[1:]
        assert w.packed.shape == (TINY.num_layers, k // 2, n)
        assert w.scales.shape == (TINY.num_layers, k // 32, n)
    # Dequantized, it is close to the folded float model (int4 g32: a few % per weight).
    folded, _ = awq_scale(tiny, QuantSpec(4, "group", 32), random_calibration(256),
                          progress=False)
    w_hat = dequantize_weight(jax.tree.map(lambda a: a[0], params["layers"]["mlp"]["up_proj"]
                                           ["kernel"]))
    w = folded["layers"]["mlp"]["up_proj"]["kernel"][0]
    assert float(jnp.linalg.norm(w_hat - w) / jnp.linalg.norm(w)) < 0.15


def test_engine_serves_awq_params(tiny):
    """The paged engine (W4A16 XLA path) serves AWQ's params, folded norms included: greedy
    tokens equal the dense oracle's on the dequantized kernels."""
    from jaxserve import LLM, SamplingParams

    params = awq_quantize(tiny, QuantSpec(4, "group", 32), random_calibration(256),
                          progress=False)
    layers = dict(params["layers"])
    for block, name in LINEARS:
        layers[block] = dict(layers[block])
        layers[block][name] = {"kernel": jax.vmap(dequantize_weight)(
            params["layers"][block][name]["kernel"])}
    oracle = dataclasses.replace(tiny, params=dict(params, layers=layers))
    prompt = [5, 17, 99, 3, 42, 7]
    want = oracle.greedy_generate(prompt, 8, stop_token_ids=[])
    llm = LLM(dataclasses.replace(tiny, params=params), max_num_seqs=1, max_model_len=64,
              kv_cache_memory=1 << 22, warmup=False, linear_backend="xla")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == want
