"""The model side of LoRA (models/lora.py): the XLA delta against a per-token numpy loop, and a
Llama whose params hold adapter slots against the same Llama with the adapter merged into its
kernels (W + scale * A^T B^T), stacked and unrolled, tokens of different slots in one call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.testing.tiny_models import TINY_GQA
from models import lora
from models.layer_layout import unstack_layers
from models.random_init import random_model

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def numpy_delta(x, a, b, slots):
    out = np.zeros((x.shape[0], b.shape[-1]), np.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = (x[t].astype(np.float64) @ a[s]) @ b[s]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,s,k,r,n", [(1, 1, 64, 8, 32), (7, 3, 64, 16, 96), (33, 4, 96, 8, 64)])
def test_dense_delta_matches_a_per_token_loop(dtype, t, s, k, r, n):
    rng = np.random.default_rng(t * 100 + s)
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = rng.standard_normal((s, k, r)).astype(np.float32) * 0.3
    b = rng.standard_normal((s, r, n)).astype(np.float32) * 0.3
    slots = rng.integers(-1, s, size=t).astype(np.int32)  # -1: no adapter
    slots[0] = -1
    dt = jnp.dtype(dtype)
    k_major = np.transpose(a, (1, 0, 2))  # [K, S, R]: the slots' stored layout
    got = np.asarray(jax.jit(lora.dense_lora_delta)(
        jnp.asarray(x, dt), jnp.asarray(k_major, dt), jnp.asarray(b, dt), jnp.asarray(slots)))
    # The reference sees the same rounded inputs: the tolerance is for the product only.
    rx, ra, rb = (np.asarray(jnp.asarray(v, dt).astype(jnp.float32)) for v in (x, a, b))
    want = numpy_delta(rx, ra, rb, slots)
    np.testing.assert_allclose(got, want, **TOL[dtype])
    assert np.all(got[slots < 0] == 0)


def _adapter(config, seed, rank, targets, max_rank):
    """Random A [L, K, R] / B [L, R, N] padded to max_rank, and the same unpadded."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in targets:
        k, n = lora.module_shapes(config)[name]
        a = np.zeros((config.num_layers, k, max_rank), np.float32)
        b = np.zeros((config.num_layers, max_rank, n), np.float32)
        a[..., :rank] = rng.standard_normal((config.num_layers, k, rank)) * 0.2
        b[:, :rank] = rng.standard_normal((config.num_layers, rank, n)) * 0.2
        out[name] = (a, b)
    return out


def _merged(params, adapter):
    layers = {k: dict(v) for k, v in params["layers"].items()}
    for name, (a, b) in adapter.items():
        parent = lora.MODULE_PARENT[name]
        node = dict(layers[parent][name])
        node["kernel"] = np.asarray(node["kernel"]) + np.einsum("lkr,lrn->lkn", a, b)
        layers[parent][name] = node
    return {**params, "layers": layers}


@pytest.mark.parametrize("unrolled", [False, True])
def test_slots_equal_merged_kernels_per_token(unrolled):
    """Two adapters in slots 0 and 1 and base tokens in one forward: each token's logits are
    those of the model with its own adapter merged (causal: a row of one adapter is a whole
    sequence here, so each sequence runs as its own batch row)."""
    c = TINY_GQA
    model = random_model(c, seed=3)
    params = jax.tree.map(np.asarray, model.params)
    targets = lora.module_shapes(c).keys()
    ad1 = _adapter(c, 1, 4, ["q_proj", "v_proj", "down_proj"], 8)
    ad2 = _adapter(c, 2, 8, list(targets), 8)
    slots = lora.slot_arrays(c, list(targets), 2, 8, np.float32)
    for s, ad in enumerate([ad1, ad2]):
        for name, (a, b) in ad.items():
            slots[name][0][:, :, s], slots[name][1][:, s] = a, b  # a [L, K, S, R]
            slots[name][2][:, s] = 1
    with_slots = lora.with_slots(params, slots)
    module = model.module(unroll_layers=unrolled)
    if unrolled:
        with_slots = unstack_layers(with_slots, c.num_layers)
    seq = np.asarray([[5, 9, 33, 2, 7, 100]], np.int32)  # [1, T]
    pos = np.arange(seq.shape[1], dtype=np.int32)[None]
    plain = model.module()
    for slot, ad in [(-1, {}), (0, ad1), (1, ad2)]:
        got = module.apply({"params": with_slots}, seq, pos,
                           lora=jnp.full((seq.shape[1],), slot, jnp.int32))[0]
        want = plain.apply({"params": _merged(params, ad)}, seq, pos)[0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # The adapters change the logits (the comparison above is not vacuous).
    base = plain.apply({"params": params}, seq, pos)[0]
    assert np.abs(np.asarray(base) - np.asarray(
        plain.apply({"params": _merged(params, ad2)}, seq, pos)[0])).max() > 1e-2


def test_write_slot_sets_one_slot_and_leaves_the_others():
    c = TINY_GQA
    model = random_model(c, seed=0)
    targets = ["q_proj", "up_proj"]
    params = lora.with_slots(jax.tree.map(np.asarray, model.params),
                             lora.slot_arrays(c, targets, 3, 4, np.float32))
    leaves = lora.slot_leaves(params, c.num_layers)
    assert set(leaves) == {("q_proj", None), ("up_proj", None)}
    ad = _adapter(c, 7, 4, targets, 4)
    new = jax.jit(lora.write_slot)(leaves, jnp.int32(1), ad)
    for name in targets:
        a, b, on = (np.asarray(v) for v in new[(name, None)])
        assert on[:, 1].all() and not on[:, [0, 2]].any()
        np.testing.assert_array_equal(a[:, :, 1], ad[name][0])  # a [L, K, S, R]
        np.testing.assert_array_equal(b[:, 1], ad[name][1])     # b [L, S, R, N]
        assert not a[:, :, [0, 2]].any() and not b[:, [0, 2]].any()
    put = lora.replace_slot_leaves(params, new)
    assert put["embedding"] is params["embedding"]  # nothing else copied
    np.testing.assert_array_equal(
        np.asarray(put["layers"]["attn"]["q_proj"]["lora_a"][:, :, 1]), ad["q_proj"][0])


def test_the_skipping_path_equals_the_dense_one_and_is_zero_without_adapters():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 32)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((32, 2, 4)), jnp.float32)  # [K, S, R]
    b = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    f = jax.jit(lambda x, a, b, s, on: lora.SKIPPING.delta(x, a, b, lora.SKIPPING.index(s, 2),
                                                           on))
    some = jnp.asarray([0, -1, 1, 1, -1, 0], jnp.int32)
    both = jnp.ones((2,), jnp.int32)
    np.testing.assert_allclose(np.asarray(f(x, a, b, some, both)),
                               np.asarray(lora.dense_lora_delta(x, a, b, some)), rtol=1e-6)
    assert not np.asarray(f(x, a, b, jnp.full((6,), -1, jnp.int32), both)).any()
    # Tokens only of slot 1, which does not adapt this layer: skipped.
    assert not np.asarray(f(x, a, b, jnp.asarray([1, -1, 1, 1, 1, 1], jnp.int32),
                            jnp.asarray([1, 0], jnp.int32))).any()
