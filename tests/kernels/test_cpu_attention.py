"""The native CPU ragged paged attention (jaxserve/native) against the float64 numpy oracle over
a grid of row mixes, block sizes, head layouts and dtypes, with NaN in every cache slot no row
may read; then as the engine's backend against the XLA path, and its selection and errors."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import native
from jaxserve.native.attention import ragged_paged_attention_cpu
from jaxserve.runtime import backends, step_layout
from jaxserve.runtime.attention_backends import CpuAttention, XlaAttention
from models.config import ModelConfig
from models.random_init import random_model
from test_backends import TINY, greedy
from test_ragged_attention_xla import make_case, oracle

# The kernel reads bf16 exactly (a widening) and does all its arithmetic in float32, so one
# tolerance serves both cache dtypes: float32 rounding over a few hundred keys.
TOL = 2e-5


def run_case(query_lens, starts, *, block_size, heads, kv_heads, head_dim, q_dtype, kv_dtype,
             extra_tokens=3):
    rng, rows, tables, tokens, num_blocks = make_case(
        1, query_lens, starts, block_size=block_size, heads=heads, kv_heads=kv_heads)
    t = tokens + extra_tokens  # idle tokens past the rows: must come back as zeros
    lay = step_layout.build(rows, tables, tokens=t, max_num_seqs=8, block_size=block_size,
                            idle_slot=8, ragged=False)
    layers, layer = 2, 1

    def rounded(shape, dtype):  # values `dtype` holds exactly
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float32)

    k = rounded((layers, num_blocks, block_size, kv_heads, head_dim), kv_dtype)
    v = rounded(k.shape, kv_dtype)
    # Poison what no row may read: unreferenced blocks, other layers, slots past each context.
    seen = np.zeros(k.shape[:3], bool)
    for row, table in zip(rows, (tables[r.slot] for r in rows)):
        pos = np.arange(row.start + len(row.tokens))
        seen[layer, table[pos // block_size], pos % block_size] = True
    kp, vp = k.copy(), v.copy()
    kp[~seen], vp[~seen] = np.nan, np.nan
    q = rounded((t, heads, head_dim), q_dtype)
    out = ragged_paged_attention_cpu(
        jnp.asarray(q, q_dtype), jnp.asarray(kp, kv_dtype), jnp.asarray(vp, kv_dtype), layer,
        lay.page_table, lay.query_start, lay.context_lens)
    assert out.dtype == jnp.float32 and out.shape == (t, heads, head_dim)
    got = np.asarray(out)
    order = [rows[i] for i in np.argsort(lay.row_index)]
    spans = [slice(lay.query_start[i], lay.query_start[i] + len(r.tokens))
             for i, r in enumerate(order)]
    want = oracle(q, k, v, layer, list(zip(order, spans)), [tables[r.slot] for r in order],
                  block_size)
    used = np.zeros(t, bool)
    for span, w in zip(spans, want):
        np.testing.assert_allclose(got[span], w, rtol=TOL, atol=TOL)
        used[span] = True
    np.testing.assert_array_equal(got[~used], 0.0)


@pytest.mark.parametrize("q_dtype,kv_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                              ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("query_lens,starts,block_size,heads,kv_heads,head_dim", [
    ([1, 1, 1], [0, 5, 40], 8, 4, 2, 32),                     # decodes only
    ([1, 1, 1, 1], [0, 3, 17, 60], 1, 4, 2, 32),              # block size 1
    ([37], [0], 8, 4, 1, 64),                                 # one prefill (MQA)
    ([20], [33], 16, 6, 2, 64),                               # a later chunk, G = 3
    ([3, 1, 17, 1, 2, 5], [9, 0, 4, 30, 50, 0], 4, 4, 4, 16),  # a mix, k-query rows (MHA)
    ([1, 16, 1], [63, 0, 12], 16, 3, 1, 128),                 # exactly one query block
    ([70, 1, 1], [100, 7, 200], 32, 8, 2, 64),                # several query blocks, G = 4
    ([2, 33], [15, 31], 5, 9, 3, 48),                         # block size not a power of 2
])
def test_matches_oracle(query_lens, starts, block_size, heads, kv_heads, head_dim, q_dtype,
                        kv_dtype):
    run_case(query_lens, starts, block_size=block_size, heads=heads, kv_heads=kv_heads,
             head_dim=head_dim, q_dtype=jnp.dtype(q_dtype), kv_dtype=jnp.dtype(kv_dtype))


def test_rejects_what_it_cannot_run():
    q = jnp.zeros((4, 4, 24), jnp.float32)  # head_dim 24: not a multiple of 16
    cache = jnp.zeros((1, 2, 4, 2, 24), jnp.float32)
    one = jnp.zeros((1,), jnp.int32)
    with pytest.raises(Exception, match="head_dim"):
        ragged_paged_attention_cpu(q, cache, cache, 0, jnp.zeros((1, 1), jnp.int32),
                                   jnp.zeros((2,), jnp.int32), one).block_until_ready()
    odd = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=24, max_position_embeddings=64)
    assert CpuAttention().supports(odd, 16) == ("head_dim 24 (kernel: a multiple of 16)",)
    assert backends.attention_backend("cpu", odd, 16, "auto") == XlaAttention()
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run head_dim 24"):
        backends.attention_backend("cpu", odd, 16, "cpu")


def test_auto_picks_the_kernel_or_falls_back(monkeypatch, caplog):
    assert native.unavailable_reason() is None  # scripts/setup.sh's build ran
    assert backends.resolve("auto", attention=True) == "cpu"
    # Linears: the native quantized matmul where it has a vector loop (test_cpu_quant_matmul).
    assert backends.resolve("auto") == ("cpu" if backends.simd() else "xla")
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert backends.resolve("auto", attention=True) == "xla"
    assert "no C++ compiler found" in caplog.text


def test_library_is_keyed_by_its_source(monkeypatch, tmp_path):
    src = tmp_path / "k.cc"
    src.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(native, "SOURCES", (src,))
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
    first = native.build()
    src.write_text("int f() { return 2; }\n")
    second = native.build()
    assert first != second and first.exists() and second.exists()
    src.write_text("int f( {\n")
    with pytest.raises(native.NativeUnavailable, match="compiling k.cc failed"):
        native.build()


def test_engine_with_the_kernel_matches_xla_and_the_dense_model():
    model = random_model(TINY, seed=7)  # head_dim 64: test_backends' engine set-up
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (3, 17, 40, 9, 70)]  # 70: chunked
    cpu = greedy(model, prompts, attention_backend="cpu")
    assert cpu == greedy(model, prompts, attention_backend="xla")
    for p, out in zip(prompts, cpu):
        assert out == model.greedy_generate(p, 8, stop_token_ids=())
