"""GGUF-native weights: the file's Q4_0/Q4_1/Q8_0 blocks served without re-quantization.

The reference is gguf's own `gguf.quants.dequantize` (llama.cpp's Python package), not ours.
"""

import logging

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import backends
from jaxserve.quantization import Int4Weight, Int8Weight, dequantize_weight, is_quantized
from jaxserve.quantization.gguf_native import gguf_native_params, native_weight
from jaxserve.quantization.linear import quantized_linear
from jaxserve.quantization.rtn import HF_LINEARS, LINEARS
from models.config import ModelConfig
from models.gguf_loader import GGUFTensor, _unpermute_rows
from models.random_init import random_model

QT = gguf.GGMLQuantizationType
NATIVE = (QT.Q4_0, QT.Q4_1, QT.Q8_0)


def gguf_tensor(w_hf: np.ndarray, qtype, name="w") -> GGUFTensor:
    """An HF-layout [N, K] float matrix quantized by gguf itself, as the loader would keep it."""
    data = gguf.quants.quantize(w_hf.astype(np.float32), qtype)  # [N, bytes per row]
    return GGUFTensor(name, name, qtype, w_hf.shape, data)


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda q: q.name)
def test_native_linear_equals_gguf_dequantize_then_matmul(qtype):
    rng = np.random.default_rng(0)
    w_hf = rng.normal(scale=0.05, size=(96, 256)).astype(np.float32)  # [N, K]
    t = gguf_tensor(w_hf, qtype)
    ref_w = gguf.quants.dequantize(t.data, qtype).reshape(96, 256).T  # [K, N]
    tree = native_weight(t)
    assert set(tree.arrays()) == {QT.Q4_0: {"packed", "scales"},
                                  QT.Q4_1: {"packed", "scales", "offsets"},
                                  QT.Q8_0: {"q8", "scales"}}[qtype]
    assert tree.scales.shape == (256 // 32, 96)
    # The pytree stands for exactly gguf's weights (f16 d, m and small codes: exact in f32).
    np.testing.assert_array_equal(np.asarray(dequantize_weight(tree)), ref_w)
    x = rng.normal(size=(5, 256)).astype(np.float32)
    y = np.asarray(quantized_linear(jnp.asarray(x), jax.tree.map(jnp.asarray, tree)))
    ref = x.astype(np.float64) @ ref_w.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_native_weight_refuses_other_block_types():
    t = gguf_tensor(np.zeros((4, 256), np.float32), QT.Q8_0)
    with pytest.raises(ValueError, match="Q6_K has no native quantized path"):
        native_weight(GGUFTensor("w", "w", QT.Q6_K, t.shape, t.data))


TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                   tie_word_embeddings=True)
TYPES = {"q_proj": QT.Q4_1, "k_proj": QT.Q4_0, "v_proj": QT.Q8_0, "o_proj": QT.Q4_1,
         "gate_proj": QT.Q8_0, "up_proj": QT.Q4_0}
# down_proj mixes code widths over layers (Q4_0, Q8_0): no one stacked pytree -> float.


def tiny_gguf_model():
    """A tiny model whose float params are gguf's dequantized blocks, plus the raw blocks."""
    model = random_model(TINY, seed=3)
    params = {**model.params, "layers": {b: dict(v) for b, v in model.params["layers"].items()}}
    raw = {}
    for (block, name), hf in zip(LINEARS, HF_LINEARS):
        kernels = np.asarray(params["layers"][block][name]["kernel"])  # [L, K, N]
        deq = []
        for i, k in enumerate(kernels):
            qtype = TYPES.get(name, (QT.Q4_0, QT.Q8_0)[i])
            t = gguf_tensor(k.T, qtype, f"model.layers.{i}.{hf}")
            raw[t.name] = t
            deq.append(gguf.quants.dequantize(t.data, qtype).reshape(k.T.shape).T)
        params["layers"][block][name] = {"kernel": jnp.asarray(np.stack(deq))}
    emb = np.asarray(params["embedding"])  # [V, D]: the tied head, Q8_0 as in SmolLM2's file
    t = gguf_tensor(emb, QT.Q8_0, "model.embed_tokens.weight")
    raw[t.name] = t
    params["embedding"] = jnp.asarray(gguf.quants.dequantize(t.data, QT.Q8_0).reshape(emb.shape))
    return model, params, raw


def test_gguf_native_model_logits_equal_dequantized_float(caplog):
    model, params, raw = tiny_gguf_model()
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        native = gguf_native_params(params, raw, TINY)
    assert "mlp.down_proj.weight (Q4_0/Q8_0)" in caplog.text
    layers = native["layers"]
    assert isinstance(layers["attn"]["q_proj"]["kernel"], Int4Weight)
    assert isinstance(layers["mlp"]["gate_proj"]["kernel"], Int8Weight)
    assert not is_quantized(layers["mlp"]["down_proj"]["kernel"])  # float fallback
    assert isinstance(native["lm_head"]["kernel"], Int8Weight)
    tokens = np.random.default_rng(1).integers(0, 128, size=(2, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
    want, _ = model.module().apply({"params": params}, tokens, positions)
    got, _ = model.module(linear=backends.linear_backend("xla")).apply(
        {"params": native}, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.model
def test_smollm2_native_pytrees_are_the_files_weights(smollm2_gguf, smollm2_path):
    """Every native kernel dequantizes to exactly the loader's float weight (which undid the
    Q/K row permutation); linear outputs equal matmuls with gguf's dequantized file tensors."""
    m = smollm2_gguf
    assert {t.qtype for t in m.raw.values()} == {QT.Q4_1, QT.Q8_0}
    native = gguf_native_params(m.params, m.raw, m.config)
    for block, name in LINEARS:
        tree = native["layers"][block][name]["kernel"]
        _, k, n = m.params["layers"][block][name]["kernel"].shape
        assert isinstance(tree, Int4Weight)
        assert tree.scales.shape[1:] == (k // 32, n)  # [L, K/32, N]
        for layer in (0, 17):
            got = np.asarray(dequantize_weight(jax.tree.map(lambda v: v[layer], tree)))
            np.testing.assert_array_equal(
                got, np.asarray(m.params["layers"][block][name]["kernel"][layer]))
    head = native["lm_head"]["kernel"]
    np.testing.assert_array_equal(np.asarray(dequantize_weight(head)),
                                  np.asarray(m.params["embedding"]).T)
    # Independently of the loader: the file's own tensors through gguf's dequantize.
    reader = gguf.GGUFReader(smollm2_path)
    by_name = {t.name: t for t in reader.tensors}
    x = np.random.default_rng(2).normal(size=(3, 576)).astype(np.float32)
    c = m.config
    cases = [("blk.5.attn_q.weight", ("attn", "q_proj"), 5, _unpermute_rows(576, c.num_heads)),
             ("blk.5.attn_k.weight", ("attn", "k_proj"), 5, _unpermute_rows(192, c.num_kv_heads)),
             ("blk.5.ffn_up.weight", ("mlp", "up_proj"), 5, None),
             ("token_embd.weight", None, None, None)]
    for gname, path, layer, order in cases:
        t = by_name[gname]
        w_file = gguf.quants.dequantize(t.data, QT(t.tensor_type))  # [N, K], file row order
        if order is not None:
            w_file = w_file[order]
        if path is None:
            tree = head
        else:
            tree = jax.tree.map(lambda v: v[layer], native["layers"][path[0]][path[1]]["kernel"])
        y = np.asarray(quantized_linear(jnp.asarray(x), tree))
        ref = x.astype(np.float64) @ w_file.T.astype(np.float64)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=gname)
