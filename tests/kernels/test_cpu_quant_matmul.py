"""The native CPU quantized matmul (jaxserve/native/cpu_quant_matmul.cc) and its repacking.

- the kernel against a numpy reference (integer dots in int64, the rest in float64) over a
  grid of rows, widths, group sizes, code widths and activation limbs;
- the repacked layout, decoded here independently of the packer, against the weight it came
  from, and GGUF Q4_0 / Q4_1 / Q8_0 blocks against gguf's own dequantization;
- the engine on the native path against a dense greedy loop over the same weights, and the
  fallback to XLA where the native library is unavailable.
"""

from __future__ import annotations

import logging
import platform

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile_guard import count_compiles
from jaxserve import EngineConfig, LLMEngine, SamplingParams, native
from jaxserve.native import isa, quant_matmul
from jaxserve.native.quant_matmul import quant_matmul_cpu, quant_matmul_reference
from jaxserve.quantization import dequantize_weight
from jaxserve.quantization.cpu_packed import pack_params, pack_weight
from jaxserve.quantization.gguf_native import native_weight
from jaxserve.quantization.paths import activation_bits, prepare_model
from jaxserve.runtime import backends
from models.model import Model
from models.quantized import CpuPackedWeight, Int4Weight, Int8Weight
from models.random_init import random_model
from pallas_kernels.int4_matmul import pack_int4
from test_gguf_native import TINY as GGUF_TINY
from test_gguf_native import gguf_tensor, tiny_gguf_model
from test_quantized_engine import PROMPTS, TINY, dense_greedy, engine_greedy

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"native library: {native.unavailable_reason()}")
QT = gguf.GGMLQuantizationType


def decode(cw: CpuPackedWeight):
    """The packed layout read back (independently of cpu_packed.py): codes u [K, N],
    scales and bias [G, N] float32 (bias = offsets + shift * scales; None without offsets),
    from the kernel's documented layout."""
    codes = np.asarray(cw.codes)  # [T, K/c, 64]
    t, chunks, _ = codes.shape
    b = codes.reshape(t, chunks, 16, 4)  # [T, o, j, b]
    if cw.bits == 4:  # byte (j, b) of octet o: rows 8 o + b (low nibble), 8 o + 4 + b (high)
        u = np.stack([b & 0xF, b >> 4], axis=3)  # [T, o, j, h, b]
        u = u.transpose(0, 2, 1, 3, 4).reshape(16 * t, 8 * chunks)  # [N16, K]
    else:
        u = b.transpose(0, 2, 1, 3).reshape(16 * t, 4 * chunks)
    n = cw.out_features

    def groups(a):  # [T, G, 16] -> [G, N] float32
        a = np.asarray(a, np.float32)
        return a.transpose(1, 0, 2).reshape(a.shape[1], -1)[:, :n]
    s = groups(cw.scales)
    bias = None if cw.offsets is None else groups(cw.offsets) + np.float32(cw.shift) * s
    return u[:n].T.astype(np.int64), s, bias


def random_weight(bits, k, n, g, offsets, rng, f16=False):
    """f16: scales and offsets that are float16 values (stored as float16, as GGUF's)."""
    s = rng.uniform(0.01, 0.1, (k // g, n)).astype(np.float32)
    b = (rng.standard_normal((k // g, n)) * 0.1).astype(np.float32) if offsets else None
    if f16:
        s = s.astype(np.float16).astype(np.float32)
        b = None if b is None else b.astype(np.float16).astype(np.float32)
    if bits == 4:
        u = rng.integers(0, 16, (k, n))
        return Int4Weight(packed=np.asarray(pack_int4(jnp.asarray(u), group_size=g)), scales=s,
                          offsets=b, group_size=g)
    c = rng.integers(-127, 128, (n, k)).astype(np.int8)
    return Int8Weight(q8=c, scales=s, offsets=b, group_size=g)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("g,offsets", [(32, True), (64, False), (128, True)])
@pytest.mark.parametrize("n", [48, 37])  # an odd multiple of 16, and a padded width
def test_packing_round_trips_the_weight(bits, g, offsets, n):
    w = random_weight(bits, 256, n, g, offsets, np.random.default_rng(0))
    cw = pack_weight(w)
    u, s, b = decode(cw)
    assert cw.zero == (8 if bits == 4 else 128) and cw.group_size == g
    assert cw.scales.dtype == jnp.float32  # random scales are not float16 values
    deq = np.repeat(s, g, 0) * (u - cw.zero) + (0 if b is None else np.repeat(b, g, 0))
    np.testing.assert_allclose(deq, np.asarray(dequantize_weight(w)), rtol=1e-6, atol=1e-7)


# (rows, K, N, g): odd and even rows (row blocks of 4 and every remainder), odd multiples of 16
# and a width the packer pads, every group size.
SHAPES = [(1, 64, 48, 32), (2, 128, 80, 64), (3, 256, 16, 128), (5, 96, 112, 32),
          (7, 128, 37, 64), (16, 256, 48, 128), (33, 64, 80, 32), (64, 128, 48, 64)]


# Each instruction-set level's loop (jaxserve/native/isa.py): this machine's build as loaded,
# and the lower levels this CPU also runs, built beside it under their own target names.
LEVELS = {"avx2": 1, "x86-64": 0}


@pytest.fixture(scope="module")
def level_targets():
    """{level: the quantized matmul's FFI target in that level's build}, for the levels below
    this machine's that it can run."""
    flags = isa.cpu_flags()
    out = {}
    for name, loop in LEVELS.items():
        build = isa.BY_NAME[name]
        if build.needs <= flags and platform.machine() in ("x86_64", "AMD64"):
            suffix = name.replace("-", "_")
            assert native.load_build(build, suffix).jaxserve_quant_matmul_isa() == loop
            out[name] = f"jaxserve_quant_matmul_{suffix}"
    return out


@pytest.mark.parametrize("limbs", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,k,n,g", SHAPES)
@pytest.mark.parametrize("level", ["loaded", "avx2"])
def test_kernel_matches_numpy_reference(m, k, n, g, bits, limbs, level, level_targets):
    if level != "loaded" and level not in level_targets:
        pytest.skip(f"this CPU does not run the {level} build")
    target = level_targets.get(level, "jaxserve_quant_matmul")
    rng = np.random.default_rng(m * 1000 + k + n)
    w = random_weight(bits, k, n, g, offsets=(m + bits) % 2 == 1, rng=rng, f16=m % 2 == 0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 1] *= 20  # an outlier channel
    cw = pack_weight(w)
    assert cw.scales.dtype == (jnp.float16 if m % 2 == 0 else jnp.float32)
    u, s, b = decode(cw)
    y = np.asarray(quant_matmul_cpu(jnp.asarray(x), cw, limbs, target=target))
    assert y.shape == (m, n) and y.dtype == np.float32
    ref = quant_matmul_reference(x, u, s, b, cw.zero, limbs)
    # Integer dots exact; float32 only in the per-group scaling and sums.
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("bits,limbs,m,f16", [(4, 1, 5, False), (4, 2, 2, True),
                                              (8, 2, 3, False), (8, 1, 1, True)])
def test_portable_loop_matches_numpy_reference(level_targets, bits, limbs, m, f16):
    if "x86-64" not in level_targets:
        pytest.skip("not an x86-64 CPU")
    rng = np.random.default_rng(bits + m)
    cw = pack_weight(random_weight(bits, 128, 37, 32, offsets=True, rng=rng, f16=f16))
    x = rng.standard_normal((m, 128)).astype(np.float32)
    y = np.asarray(quant_matmul_cpu(jnp.asarray(x), cw, limbs,
                                 target=level_targets["x86-64"]))
    u, s, b = decode(cw)
    ref = quant_matmul_reference(x, u, s, b, cw.zero, limbs)
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


def test_rows_are_independent_and_zero_rows_give_the_bias_sums():
    rng = np.random.default_rng(3)
    cw = pack_weight(random_weight(4, 128, 48, 32, True, rng))
    x = rng.standard_normal((6, 128)).astype(np.float32)
    x[4] = 0.0  # sx = 0 -> 1: codes 0, output 0
    both = np.asarray(quant_matmul_cpu(jnp.asarray(x), cw, 2))
    one = np.asarray(quant_matmul_cpu(jnp.asarray(x[2:3]), cw, 2))
    np.testing.assert_array_equal(one[0], both[2])
    np.testing.assert_array_equal(both[4], 0.0)


@pytest.mark.parametrize("bits,offsets,f16", [(4, True, True), (4, False, False),
                                               (8, True, False)])
def test_a_stacked_weight_is_read_in_place_at_its_layer(bits, offsets, f16):
    """Layer i of a stack [L, ...] (CpuPackedWeight.at_layer, what the unrolled step hands
    the kernel) against the numpy reference on layer i's own weight: every layer, so a wrong
    offset of the codes, scales or offsets reads another layer's numbers."""
    rng = np.random.default_rng(11)
    k, n, g = 128, 48, 32
    ws = [random_weight(bits, k, n, g, offsets, rng, f16) for _ in range(3)]
    stacked = pack_weight(jax.tree.map(lambda *a: np.stack(a), *ws))
    assert stacked.codes.ndim == 4 and (stacked.scales.dtype == jnp.float16) == f16
    x = rng.standard_normal((3, k)).astype(np.float32)
    for i, w in enumerate(ws):
        u, s, b = decode(pack_weight(w))
        want = quant_matmul_reference(x, u, s, b, stacked.zero, 2)
        got = np.asarray(quant_matmul_cpu(jnp.asarray(x), stacked.at_layer(i), 2))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_stacked_weight_needs_its_layer_and_a_layer_in_range():
    rng = np.random.default_rng(12)
    stacked = pack_weight(jax.tree.map(lambda *a: np.stack(a), *[
        random_weight(4, 64, 16, 32, True, rng) for _ in range(2)]))
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="needs its layer"):
        quant_matmul_cpu(x, stacked, 2)
    with pytest.raises(Exception, match=r"layer 2 is out of range \[0, 2\)"):
        jax.block_until_ready(quant_matmul_cpu(x, stacked.at_layer(2), 2))
    with pytest.raises(ValueError, match="needs stacked codes"):
        pack_weight(random_weight(4, 64, 16, 32, True, rng)).at_layer(0)


def test_quantized_activations_round_half_to_even_like_xla():
    """Ties of x / sx land on even codes in the kernel as in jnp.round (the W8A8 path)."""
    from jaxserve.quantization.linear import quantize_activations
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 4.0, 5.5] * 4], np.float32)  # sx = 1
    xq, sx = quantize_activations(jnp.asarray(x))
    q, sx_ref = quant_matmul.quantize_rows_reference(x, 1)
    np.testing.assert_array_equal(np.asarray(xq), q[0])
    # A one-hot int8 weight column per input reads the codes back through the kernel.
    k = x.shape[1]
    eye = Int8Weight(q8=np.eye(k, dtype=np.int8), scales=np.ones((1, k), np.float32),
                     group_size=k)
    y = np.asarray(quant_matmul_cpu(jnp.asarray(x), pack_weight(eye), 1))
    np.testing.assert_array_equal(y, q[0].astype(np.float32) * sx_ref[:, None])


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_repack_to_ggufs_own_dequantization(qtype):
    rng = np.random.default_rng(0)
    w_hf = rng.normal(scale=0.05, size=(80, 256)).astype(np.float32)  # [N, K]
    t = gguf_tensor(w_hf, qtype)
    ref_w = gguf.quants.dequantize(t.data, qtype).reshape(80, 256).T  # [K, N], llama.cpp's
    cw = pack_weight(native_weight(t))
    assert cw.scales.dtype == jnp.float16  # d and m as in the file: exact, half the bytes
    u, s, b = decode(cw)
    deq = np.repeat(s, 32, 0) * (u - cw.zero) + (0 if b is None else np.repeat(b, 32, 0))
    # Q4_1's d u + m becomes d (u - 8) + (m + 8 d): float32 rounding of m + 8 d only.
    tol = 0 if qtype != QT.Q4_1 else 1e-7
    np.testing.assert_allclose(deq, ref_w, rtol=0, atol=tol)
    x = rng.normal(size=(3, 256)).astype(np.float32)
    y = np.asarray(quant_matmul_cpu(jnp.asarray(x), cw, 2))
    exact = x.astype(np.float64) @ ref_w.astype(np.float64)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize("path", ["w4a16", "w4a8", "gguf"])
def test_engine_on_native_path_equals_dense_oracle(path):
    if path == "gguf":
        _, params, raw = tiny_gguf_model()
        model = Model(config=GGUF_TINY, params=params, tokenizer=None, dtype="float32",
                      source="tiny.gguf", raw=raw)
        prompts = [[t % 128 for t in p[:6]] for p in PROMPTS]
    else:
        model, prompts = random_model(TINY, seed=5), PROMPTS
    qmodel, _ = prepare_model(model, path)
    packed = pack_params(qmodel.params)
    kinds = {type(w).__name__ for w in jax.tree.leaves(
        packed, is_leaf=lambda x: isinstance(x, (CpuPackedWeight, Int4Weight, Int8Weight)))}
    assert "CpuPackedWeight" in kinds and "Int4Weight" not in kinds
    linear = backends.linear_backend("cpu", activation_bits(path))
    want = [dense_greedy(qmodel, packed, linear, p) for p in prompts]
    got = engine_greedy(model, prompts, path, linear_backend="cpu")
    assert got == want
    if path == "gguf":  # the file's weights, as the float engine on the dequantized ones
        assert got == engine_greedy(model, prompts, "none")


def test_native_path_compiles_nothing_after_warmup():
    engine = LLMEngine(EngineConfig(model="tiny", block_size=16, max_num_seqs=4, max_model_len=64,
                                    max_num_batched_tokens=32, warmup=True, quantization="w4a8",
                                    linear_backend="cpu"), model=random_model(TINY, seed=5))
    assert any(isinstance(w, CpuPackedWeight) for w in jax.tree.leaves(
        engine.model.params, is_leaf=lambda x: isinstance(x, CpuPackedWeight)))
    with count_compiles() as events:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(temperature=0.5, max_tokens=5, seed=i))
        while engine.has_unfinished_requests():
            engine.step()
    assert events == [] and engine.stats()["num_compiles_after_warmup"] == 0


def test_fallback_to_xla_without_the_native_library(monkeypatch, caplog):
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert backends.resolve("auto") == "xla"
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ValueError, match="unavailable here.*no C\\+\\+ compiler"):
        backends.resolve("cpu")
    model = random_model(TINY, seed=5)
    engine = LLMEngine(EngineConfig(model="tiny", block_size=16, max_num_seqs=4, max_model_len=64,
                                    max_num_batched_tokens=32, warmup=False,
                                    quantization="w4a16"), model=model)
    assert isinstance(engine.model.params["layers"]["mlp"]["up_proj"]["kernel"], Int4Weight)
    qmodel, _ = prepare_model(model, "w4a16")
    want = [dense_greedy(qmodel, qmodel.params, backends.linear_backend("xla"), p)
            for p in PROMPTS]
    assert engine_greedy(model, PROMPTS, "w4a16") == want


def test_portable_build_is_not_picked_for_linears(monkeypatch):
    monkeypatch.setattr(backends, "simd", lambda: False)
    assert backends.resolve("auto") == "xla"
    assert backends.resolve("auto", attention=True) == "cpu"
