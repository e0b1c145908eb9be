"""The fused block (models/fused.py; the GPU decode step's fused-linear kernel, interpreted)
against the plain one on the same params: q/k/v with their norm (and biases), o_proj and down
with their residual adds, gate/up with their norm and SiLU, and, where the attention takes q,
k and v packed, RoPE in the q/k/v kernel. Same logits within f32 summation order; the params
tree is the plain model's; models the fused block does not cover are refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.backends import PallasFusedLinear
from jaxserve.testing.tiny_models import TINY_GQA
from models.config import RopeScaling
from models.fused import fusable, rope_fusable
from models.llama import Llama, dense_causal_attention
from models.random_init import random_model

FUSED = PallasFusedLinear(interpret=True)
# 32-wide heads (RoPE fusable: half a head is one 16-column tile), biases on q/k/v (Qwen2),
# a scaled RoPE (linear, factor 2), RMSNorm eps 1e-5.
CONFIG = dataclasses.replace(TINY_GQA, hidden_size=128, intermediate_size=256, head_dim=32,
                             attention_bias=True, rms_norm_eps=1e-5,
                             rope_scaling=RopeScaling(rope_type="linear", factor=2.0))


def packed_dense_attention(qkv, cache, layer, meta, *, num_heads, **kw):
    """attend_packed over the dense oracle: split q, k, v as AttentionBackend does."""
    kv = (qkv.shape[2] - num_heads) // 2
    q, k, v = jnp.split(qkv, (num_heads, num_heads + kv), axis=2)
    return dense_causal_attention(q, k, v, cache, layer, meta, **kw)


@pytest.mark.parametrize("packed", [False, True], ids=["rope-in-xla", "rope-in-kernel"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_block_equals_the_plain_block(packed, tokens):
    model = random_model(CONFIG, seed=11)
    # Biases and norm scales away from their init (zeros, ones), so both are really applied.
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: (p + rng.normal(size=p.shape).astype(p.dtype) * 0.3
                         if path[-1].key in ("bias", "scale") else p), model.params)
    seq = np.asarray([[5, 9, 33, 2, 7, 100, 17][:tokens]], np.int32)  # [1, T]
    pos = np.arange(3, 3 + tokens, dtype=np.int32)[None]  # not from 0: RoPE angles vary
    plain = model.module()
    fused = Llama(CONFIG, dtype=jnp.float32, unroll_layers=False, fused_linear=FUSED,
                  attention_packed=packed_dense_attention if packed else None)
    want, _ = plain.apply({"params": params}, seq, pos)
    got, _ = fused.apply({"params": params}, seq, pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Not vacuous: the biases and norm scales move the logits.
    base, _ = plain.apply({"params": model.params}, seq, pos)
    assert np.abs(np.asarray(base) - np.asarray(want)).max() > 1e-2


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_fused_head_equals_the_plain_head(tied):
    """The logits rows' gather, the final norm and the LM head in one fused call (a tied
    head reads the embedding transposed): the plain model's logits for the rows asked, in
    the order asked."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    model = random_model(config, seed=5)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(  # the final norm's scale away from ones
        lambda path, p: (p + rng.normal(size=p.shape).astype(p.dtype) * 0.3
                         if path[-1].key == "scale" else p), model.params)
    assert ("lm_head" in params) != tied
    seq = np.asarray([[5, 9, 33, 2, 7, 100, 17]], np.int32)  # [1, 7]
    pos = np.arange(7, dtype=np.int32)[None]
    index = jnp.asarray([6, 2, 4], jnp.int32)  # [R]
    want, _ = model.module().apply({"params": params}, seq, pos, logits_index=index)
    got, _ = Llama(config, fused_linear=FUSED).apply({"params": params}, seq, pos,
                                                     logits_index=index)
    assert got.shape == (3, config.vocab_size) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_vocabulary_the_kernel_tiles_do_not_divide_keeps_the_plain_head():
    config = dataclasses.replace(CONFIG, vocab_size=250)
    model = random_model(config, seed=5)
    seq, pos = np.asarray([[5, 9]], np.int32), np.asarray([[0, 1]], np.int32)
    want, _ = model.module().apply({"params": model.params}, seq, pos)
    got, _ = Llama(config, fused_linear=FUSED).apply({"params": model.params}, seq, pos)
    assert got.shape == (1, 2, 250)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_fused_params_are_the_plain_ones():
    """A fused model initialises the same tree (names, shapes) as the plain one."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    plain = jax.eval_shape(lambda k: Llama(CONFIG).init(k, tokens, tokens),
                           jax.random.key(0))
    fused = jax.eval_shape(lambda k: Llama(CONFIG, fused_linear=FUSED).init(k, tokens, tokens),
                           jax.random.key(0))
    assert jax.tree.structure(plain) == jax.tree.structure(fused)
    assert jax.tree.map(lambda a: a.shape, plain) == jax.tree.map(lambda a: a.shape, fused)


def test_steps_past_the_kernel_rows_run_the_plain_block():
    """A prefill-sized step (more rows than the kernel takes) runs the plain block: the same
    logits with fused_linear set."""
    model = random_model(CONFIG, seed=2)
    t = FUSED.max_rows + 1
    seq = (np.arange(t, dtype=np.int32) % 200)[None]
    pos = np.arange(t, dtype=np.int32)[None]
    want, _ = model.module().apply({"params": model.params}, seq, pos)
    got, _ = Llama(CONFIG, fused_linear=FUSED).apply({"params": model.params}, seq, pos)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_models_the_fused_block_does_not_cover_are_refused():
    gemma = dataclasses.replace(CONFIG, architecture="gemma2", hidden_act="gelu_pytorch_tanh")
    assert "Gemma" in fusable(gemma)
    assert fusable(dataclasses.replace(CONFIG, hidden_act="gelu_pytorch_tanh"))
    assert fusable(CONFIG) is None
    tokens = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="fused linears cannot run this model"):
        jax.eval_shape(lambda k: Llama(gemma, fused_linear=FUSED).init(k, tokens, tokens),
                       jax.random.key(0))
    assert rope_fusable(CONFIG)
    assert not rope_fusable(dataclasses.replace(CONFIG, qk_norm="per_head"))
    assert not rope_fusable(dataclasses.replace(CONFIG, head_dim=16))  # half a head: 8

