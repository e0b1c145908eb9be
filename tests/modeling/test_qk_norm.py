"""q/k RMSNorm in the attention block (ModelConfig.qk_norm) against a numpy decoder."""

import dataclasses

import jax
import numpy as np
import pytest

import numpy_decoder
from models.config import ModelConfig
from models.random_init import random_model
from models.weights import param_shapes

BASE = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
IDS = [3, 50, 7, 7, 91, 12, 0, 33, 64, 5, 18]


def _perturbed(model, seed=1):
    """Norm scales start at 1; random ones make a missing or misplaced norm visible."""
    rng = np.random.default_rng(seed)

    def bump(path, a):
        names = [getattr(k, "key", None) for k in path]
        return a + 0.3 * rng.standard_normal(a.shape).astype(a.dtype) if "scale" in names else a
    return dataclasses.replace(model, params=jax.tree_util.tree_map_with_path(bump, model.params))


@pytest.mark.parametrize("qk_norm", ["none", "per_head", "full"])
def test_qk_norm_matches_numpy(qk_norm):
    model = _perturbed(random_model(dataclasses.replace(BASE, qk_norm=qk_norm), seed=2))
    want = numpy_decoder.forward(model.params, model.config, IDS)
    np.testing.assert_allclose(model.forward_logits(IDS), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("qk_norm, q_shape, k_shape", [("per_head", (16,), (16,)),
                                                       ("full", (64,), (32,))])
def test_qk_norm_params(qk_norm, q_shape, k_shape):
    config = dataclasses.replace(BASE, qk_norm=qk_norm)
    attn = random_model(config).params["layers"]["attn"]
    assert attn["q_norm"]["scale"].shape == (2, *q_shape)
    assert attn["k_norm"]["scale"].shape == (2, *k_shape)
    shapes = param_shapes(config)
    assert shapes["layers/attn/q_norm/scale"] == (2, *q_shape)
    assert config.num_params() == BASE.num_params() + 2 * (q_shape[0] + k_shape[0])


def test_no_qk_norm_params_by_default():
    assert "q_norm" not in random_model(BASE).params["layers"]["attn"]
    assert not any("norm" in k and "attn" in k for k in param_shapes(BASE))


def test_qk_norm_is_validated():
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        dataclasses.replace(BASE, qk_norm="layer")


@pytest.mark.parametrize("qk_norm", ["per_head", "full"])
def test_qk_norm_in_the_gpu_step_shape(qk_norm):
    """Unrolled per-layer weights (the GPU step) read the norms too, and the step lowers for
    CUDA (abstract H200)."""
    import jax.numpy as jnp
    from cuda_lowering import lower_for_h200
    from models.layer_layout import unstack_layers
    model = _perturbed(random_model(dataclasses.replace(BASE, qk_norm=qk_norm), seed=3))
    per_layer = unstack_layers(model.params, BASE.num_layers)
    module = model.module(unroll_layers=True)
    tokens = jnp.asarray([IDS], jnp.int32)  # [1, T]
    positions = jnp.arange(len(IDS), dtype=jnp.int32)[None]

    def forward(params, tokens, positions):
        return module.apply({"params": params}, tokens, positions)[0]
    np.testing.assert_allclose(np.asarray(forward(per_layer, tokens, positions))[0],
                               numpy_decoder.forward(model.params, model.config, IDS),
                               atol=2e-4, rtol=0)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), per_layer)
    text = lower_for_h200(forward, abstract, jax.ShapeDtypeStruct(tokens.shape, jnp.int32),
                          jax.ShapeDtypeStruct(positions.shape, jnp.int32))
    # Per layer: input, post-attention, q and k norms; then the final norm.
    assert text.count("stablehlo.rsqrt") == 4 * BASE.num_layers + 1
