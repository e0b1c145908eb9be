"""int8 KV cache (kv_cache_dtype="int8", jaxserve/runtime/kv_quant.py): quantization against a
numpy implementation; every attention path with an int8 cache against the float64 oracle applied
to the dequantized cache, with NaN scales and out-of-range codes in every slot no row may read;
block copies; the engine against the dense model whose attention reads the same quantized K/V;
memory planning and config errors. The Pallas kernels' sm_90a compiles are at the end."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.native.attention import ragged_paged_attention_cpu
from jaxserve.runtime import kv_quant, step_layout
from jaxserve.runtime.attention import ragged_attention_xla, write_kv
from jaxserve.runtime.kv_cache import KVCache, PagedMeta, new_cache, plan_num_blocks
from jaxserve.runtime.step_call import copy_blocks as _copy_blocks
from jaxserve.tools.kv_size import SCALE_BYTES as KV_SIZE_SCALE_BYTES, kv_size
from models.llama import dense_causal_attention
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200
from pallas_kernels.cases import ATTENTION_MODELS, attention_tolerance, paged_case, quantize_kv_np
from test_backends import BF16_NEAR_TIE, TINY, agree_before_near_ties, greedy, greedy_top2
from test_buckets_config import SMOLLM2
from test_ragged_attention_xla import make_case, oracle
import test_ragged_paged_attention as rpa
from test_ragged_paged_attention_mgpu import many_warpgroups

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# Against the oracle on the dequantized cache, an int8 path differs from a float one only in
# where the scales multiply (logits and probabilities, in float32), so the float tolerances
# hold: f32 queries, float32 rounding; bf16 queries, the bf16 rounding of q and of p.
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


# ---- quantization ---------------------------------------------------------------------------

def test_quantize_matches_numpy_and_round_trips():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4, 64)).astype(np.float32)
    x[0, 0, 0] = 0.0                     # a zero vector: scale 0, codes 0
    x[1, 2] *= 1e4                       # magnitudes far apart
    x[2, 3] *= 1e-4
    x[2, 4, 1, :] = np.float32(-7.5)     # all equal: the max maps to -127 exactly
    codes, scale = jax.jit(kv_quant.quantize)(jnp.asarray(x))
    want_codes, want_scale, deq = quantize_kv_np(x)
    assert codes.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    assert np.abs(np.asarray(codes, np.int32)).max() == 127
    assert (np.asarray(codes)[0, 0, 0] == 0).all() and want_scale[0, 0, 0] == 0
    # Round trip: within half a step of each vector's scale, exact at the max.
    back = np.asarray(kv_quant.dequantize(codes, scale), np.float64)
    np.testing.assert_allclose(back, deq, rtol=1e-7, atol=0)
    err = np.abs(back - x)
    assert (err <= want_scale[..., None] * (0.5 + 1e-5)).all()
    np.testing.assert_allclose(np.asarray(x)[2, 4, 1], back[2, 4, 1], rtol=1e-7)


def test_bf16_input_quantizes_from_its_values():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 2, 32)), jnp.bfloat16)
    codes, scale = kv_quant.quantize(x)
    want_codes, want_scale, _ = quantize_kv_np(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)


def test_cache_leaves_share_the_block_axis_and_copies_move_scales():
    shape = (2, 6, 4, 3, 32)  # [L, NB, BS, K, Dh]
    cache = new_cache(shape, jnp.int8)
    assert cache.quantized and cache.k.dtype == jnp.int8
    assert cache.k_scale.shape == cache.v_scale.shape == shape[:-1]
    assert not new_cache(shape, jnp.bfloat16).quantized
    rng = np.random.default_rng(2)
    k = jnp.asarray(rng.standard_normal((1, 8, 3, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 8, 3, 32)), jnp.float32)
    slots = jnp.asarray([[4, 5, 6, 7, 8, 9, 10, 11]], jnp.int32)  # blocks 1 and 2
    cache = jax.jit(write_kv)(cache, jnp.int32(1), k, v, slots)
    kc, ks, _ = quantize_kv_np(np.asarray(k[0]))
    vc, vs, _ = quantize_kv_np(np.asarray(v[0]))
    np.testing.assert_array_equal(np.asarray(cache.k)[1, 1:3].reshape(8, 3, 32), kc)
    np.testing.assert_array_equal(np.asarray(cache.k_scale)[1, 1:3].reshape(8, 3), ks)
    np.testing.assert_array_equal(np.asarray(cache.v)[1, 1:3].reshape(8, 3, 32), vc)
    np.testing.assert_array_equal(np.asarray(cache.v_scale)[1, 1:3].reshape(8, 3), vs)
    # Copy-on-write: block 2 -> 5 copies codes and scales of every layer.
    before = jax.tree.map(np.asarray, cache)
    copied = jax.jit(_copy_blocks)(cache, jnp.asarray([[2, 5], [0, 0]], jnp.int32))
    for name in ("k", "v", "k_scale", "v_scale"):
        got, old = np.asarray(getattr(copied, name)), getattr(before, name)
        np.testing.assert_array_equal(got[:, 5], old[:, 2])
        np.testing.assert_array_equal(np.delete(got, 5, axis=1), np.delete(old, 5, axis=1))


# ---- the XLA path ---------------------------------------------------------------------------

@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("query_lens,starts,block_size,heads,kv_heads", [
    ([1, 1, 1], [0, 5, 40], 8, 4, 2),                      # decodes only
    ([1, 1, 1, 1], [0, 3, 17, 60], 1, 4, 2),               # block size 1
    ([3, 1, 17, 1, 2, 5], [9, 0, 4, 30, 50, 0], 4, 4, 4),  # a mix, k-query rows, gaps
    ([1, 16, 1], [63, 0, 12], 16, 3, 1),                   # exactly one chunk
])
def test_xla_path_matches_oracle_on_dequantized_cache(query_lens, starts, block_size, heads,
                                                      kv_heads, merge, q_dtype):
    rng, rows, tables, tokens, num_blocks = make_case(
        0, query_lens, starts, block_size=block_size, heads=heads, kv_heads=kv_heads)
    dh, layers, layer = 32, 2, 1
    lay = step_layout.build(rows, tables, tokens=tokens, max_num_seqs=8, block_size=block_size,
                            idle_slot=8, ragged=True)
    qdt = jnp.dtype(q_dtype)

    def rounded(shape):  # values q's dtype holds exactly
        return np.array(jnp.asarray(rng.standard_normal(shape), qdt), np.float32)

    shape = (layers, num_blocks, block_size, kv_heads, dh)
    k_prev, v_prev = rounded(shape), rounded(shape)
    # Poison what no row may read: other layers, unreferenced blocks, slots past each context.
    seen = np.zeros(shape[:3], bool)
    for row in rows:
        pos = np.arange(row.start + len(row.tokens))
        seen[layer, tables[row.slot][pos // block_size], pos % block_size] = True
    k_prev[~seen], v_prev[~seen] = np.nan, np.nan
    kc, ks, _ = quantize_kv_np(k_prev)
    vc, vs, _ = quantize_kv_np(v_prev)
    t = tokens
    q, k, v = (rounded((1, t, n, dh)) for n in (heads, kv_heads, kv_heads))
    meta = PagedMeta(positions=lay.positions[None], slots=lay.write_slots[None],
                     query_start=lay.query_start, context_lens=lay.context_lens,
                     page_table=np.zeros((len(lay.context_lens), 1), np.int32), pairs=lay.pairs,
                     num_pairs=lay.num_pairs, multi=lay.multi, chunk_pages=lay.chunk_pages)
    cache = KVCache(k=jnp.asarray(kc), v=jnp.asarray(vc), k_scale=jnp.asarray(ks),
                    v_scale=jnp.asarray(vs))
    fn = jax.jit(lambda q, k, v, c, m: ragged_attention_xla(q, k, v, c, jnp.int32(layer), m,
                                                            merge))
    out, cache = fn(jnp.asarray(q, qdt), jnp.asarray(k, qdt), jnp.asarray(v, qdt), cache, meta)
    assert out.dtype == qdt and cache.k.dtype == jnp.int8
    # The step's writes, quantized: the oracle reads the cache as written.
    real = lay.token_slot != 8
    written = lay.write_slots[real]
    blk, off = written // block_size, written % block_size
    for name, codes, scales, x in (("k", kc, ks, k), ("v", vc, vs, v)):
        c, s, _ = quantize_kv_np(x[0, real])
        codes[layer, blk, off], scales[layer, blk, off] = c, s
        # Block 0 (the null block) takes the idle tokens' writes: anything.
        np.testing.assert_array_equal(np.asarray(getattr(cache, name))[:, 1:], codes[:, 1:])
        np.testing.assert_array_equal(np.asarray(getattr(cache, name + "_scale"))[:, 1:],
                                      scales[:, 1:])
    kd = kc.astype(np.float64) * ks[..., None]
    vd = vc.astype(np.float64) * vs[..., None]
    order = [rows[i] for i in np.argsort(lay.row_index)]
    spans = [slice(lay.query_start[i], lay.query_start[i] + len(r.tokens))
             for i, r in enumerate(order)]
    want = oracle(q[0], kd, vd, layer, list(zip(order, spans)), [tables[r.slot] for r in order],
                  block_size)
    got = np.asarray(out[0], np.float32)
    for span, w in zip(spans, want):
        assert np.isfinite(got[span]).all()
        np.testing.assert_allclose(got[span], w, rtol=TOL[q_dtype], atol=TOL[q_dtype])


# ---- the native CPU kernel --------------------------------------------------------------------

@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("query_lens,starts,block_size,heads,kv_heads,head_dim", [
    ([1, 1, 1], [0, 5, 40], 8, 4, 2, 32),                     # decodes only
    ([37], [0], 8, 4, 1, 64),                                 # one prefill (MQA)
    ([3, 1, 17, 1, 2, 5], [9, 0, 4, 30, 50, 0], 4, 4, 4, 16),  # a mix, k-query rows (MHA)
    ([70, 1, 1], [100, 7, 200], 32, 8, 2, 64),                # several query blocks, G = 4
    ([2, 33], [15, 31], 5, 9, 3, 48),                         # block size not a power of 2
])
def test_cpu_kernel_matches_oracle_on_dequantized_cache(query_lens, starts, block_size, heads,
                                                        kv_heads, head_dim, q_dtype):
    rng, rows, tables, tokens, num_blocks = make_case(
        1, query_lens, starts, block_size=block_size, heads=heads, kv_heads=kv_heads)
    t = tokens + 3  # idle tokens past the rows: must come back as zeros
    lay = step_layout.build(rows, tables, tokens=t, max_num_seqs=8, block_size=block_size,
                            idle_slot=8, ragged=False)
    layers, layer = 2, 1
    shape = (layers, num_blocks, block_size, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    seen = np.zeros(shape[:3], bool)
    for row, table in zip(rows, (tables[r.slot] for r in rows)):
        pos = np.arange(row.start + len(row.tokens))
        seen[layer, table[pos // block_size], pos % block_size] = True
    k[~seen], v[~seen] = np.nan, np.nan
    kc, ks, kd = quantize_kv_np(k)
    vc, vs, vd = quantize_kv_np(v)
    qdt = jnp.dtype(q_dtype)
    q = np.asarray(jnp.asarray(rng.standard_normal((t, heads, head_dim)), qdt), np.float32)
    out = ragged_paged_attention_cpu(jnp.asarray(q, qdt), jnp.asarray(kc), jnp.asarray(vc), layer,
                                     lay.page_table, lay.query_start, lay.context_lens,
                                     k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    assert out.dtype == jnp.float32
    got = np.asarray(out)
    order = [rows[i] for i in np.argsort(lay.row_index)]
    spans = [slice(lay.query_start[i], lay.query_start[i] + len(r.tokens))
             for i, r in enumerate(order)]
    want = oracle(q, kd, vd, layer, list(zip(order, spans)), [tables[r.slot] for r in order],
                  block_size)
    used = np.zeros(t, bool)
    for span, w in zip(spans, want):
        # The kernel dequantizes into its float32 tiles: float32 rounding whatever q's dtype.
        np.testing.assert_allclose(got[span], w, rtol=2e-5, atol=2e-5)
        used[span] = True
    np.testing.assert_array_equal(got[~used], 0.0)


def test_cpu_kernel_refuses_int8_without_scales():
    q = jnp.zeros((4, 4, 32), jnp.float32)
    cache = jnp.zeros((1, 2, 4, 2, 32), jnp.int8)
    table, qs = jnp.zeros((1, 1), jnp.int32), jnp.zeros((2,), jnp.int32)
    cl = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="int8 cache comes with k_scale and v_scale"):
        ragged_paged_attention_cpu(q, cache, cache, 0, table, qs, cl)
    scales = jnp.zeros((1, 2, 4, 2), jnp.float32)
    with pytest.raises(ValueError, match="float cache with none"):
        ragged_paged_attention_cpu(q, cache.astype(jnp.float32), cache.astype(jnp.float32), 0,
                                   table, qs, cl, k_scale=scales, v_scale=scales)


# ---- the Pallas kernels -----------------------------------------------------------------------

def quantized(k, v):
    """The NaN-filled float case caches as int8 (codes, scales) and their dequantized float64."""
    kc, ks, kd = quantize_kv_np(np.asarray(k, np.float32))
    vc, vs, vd = quantize_kv_np(np.asarray(v, np.float32))
    return (jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(ks), jnp.asarray(vs)), (kd, vd)


# (q dtype, head_dim, block_size, group, mix, queries_per_tile): from the float grid's cover.
RAGGED_CASES = [
    ("f32", 64, 8, 1, "mixed", 16),
    ("f32", 128, 16, 3, "decode", None),
    ("f32", 64, 32, 4, "prefill", 4),
    ("bf16", 128, 8, 4, "decode", None),
    ("bf16", 64, 16, 1, "prefill", None),
    ("bf16", 128, 32, 3, "mixed", 4),
]


def ragged_int8_case(case):
    dtype, head_dim, block_size, group, mix, bq = case
    dtype = rpa.DTYPES[dtype]
    q, k, v, pt, qs, cl = rpa.make_case(0, dtype=jnp.float32, block_size=block_size,
                                        group=group, head_dim=head_dim, mix=mix)
    (kc, vc, ks, vs), (kd, vd) = quantized(k, v)
    return dtype, bq, q.astype(dtype), (kc, vc, ks, vs), (kd, vd), (pt, qs, cl)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=rpa.case_id)
def test_ragged_kernel_matches_oracle_on_dequantized_cache(case, interpret):
    dtype, bq, q, (kc, vc, ks, vs), (kd, vd), (pt, qs, cl) = ragged_int8_case(case)
    out = ragged_paged_attention(q, kc, vc, jnp.int32(rpa.LAYER), pt, qs, cl, k_scale=ks,
                                 v_scale=vs, queries_per_tile=bq, interpret=interpret)
    rpa.check(out, (q, kd, vd, rpa.LAYER, pt, qs, cl), dtype)


@pytest.mark.parametrize("case", RAGGED_CASES[:2] + RAGGED_CASES[3:4], ids=rpa.case_id)
def test_ragged_reference_matches_oracle_on_dequantized_cache(case):
    dtype, _, q, (kc, vc, ks, vs), (kd, vd), (pt, qs, cl) = ragged_int8_case(case)
    out = jax.jit(ragged_paged_attention_reference)(q, kc, vc, rpa.LAYER, pt, qs, cl,
                                                    k_scale=ks, v_scale=vs)
    rpa.check(out, (q, kd, vd, rpa.LAYER, pt, qs, cl), dtype)


def test_ragged_kernel_splits_and_window_with_int8(interpret):
    # Several splits (a combine) and a sliding window, against the int8 reference.
    _, _, q, (kc, vc, ks, vs), _, (pt, qs, cl) = ragged_int8_case(RAGGED_CASES[0])
    kw = dict(k_scale=ks, v_scale=vs, window=jnp.int32(7), softcap=20.0)
    out = ragged_paged_attention(q, kc, vc, jnp.int32(rpa.LAYER), pt, qs, cl, num_splits=3,
                                 interpret=interpret, **kw)
    ref = ragged_paged_attention_reference(q, kc, vc, rpa.LAYER, pt, qs, cl, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref),
                               **attention_tolerance(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size,group,head_dim", [(8, 3, 64), (16, 4, 128), (32, 1, 64)])
def test_decode_kernel_matches_reference_on_dequantized_cache(dtype, block_size, group,
                                                              head_dim, interpret):
    num_pages = 5
    lens = [1, block_size + 3, 2 * block_size, num_pages * block_size, 0]
    q, k, v, pt, cl = paged_case(0, dtype=jnp.float32, block_size=block_size, num_kv_heads=2,
                                 group=group, head_dim=head_dim, lens=lens, num_pages=num_pages,
                                 live_layers=[1])
    (kc, vc, ks, vs), (kd, vd) = quantized(k, v)
    q = q.astype(dtype)
    out = paged_attention(q, kc, vc, jnp.int32(1), pt, cl, k_scale=ks, v_scale=vs,
                          pages_per_split=2, interpret=interpret)
    # The reference on the float64-dequantized cache (as float32: NaN where unread).
    ref = paged_attention_reference(q.astype(jnp.float32), jnp.asarray(kd, jnp.float32),
                                    jnp.asarray(vd, jnp.float32), 1, pt, cl)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref),
                               **attention_tolerance(dtype))
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
    # Its own reference reads the int8 cache the same way.
    own = paged_attention_reference(q, kc, vc, 1, pt, cl, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(own, np.float32), np.asarray(ref),
                               **attention_tolerance(dtype))


def test_kernels_refuse_mismatched_scales():
    q = jnp.zeros((4, 4, 64), jnp.float32)
    codes = jnp.zeros((1, 3, 8, 2, 64), jnp.int8)
    scales = jnp.zeros((1, 3, 8, 2), jnp.float32)
    pt, qs, cl = jnp.zeros((1, 2), jnp.int32), jnp.asarray([0, 4], jnp.int32), jnp.full((1,), 4)
    for kw, message in [({}, "needs its k_scale and v_scale"),
                        (dict(k_scale=scales), "both k_scale and v_scale"),
                        (dict(k_scale=scales[..., :1], v_scale=scales), "k_scale must be"),
                        (dict(k_scale=scales.astype(jnp.bfloat16), v_scale=scales),
                         "k_scale must be float32")]:
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(q, codes, codes, 0, pt, qs, cl, interpret=True, **kw)
    with pytest.raises(ValueError, match="scales come with an int8 cache"):
        paged_attention(q[:1], codes.astype(jnp.float32), codes.astype(jnp.float32), 0, pt, cl[:1],
                        k_scale=scales, v_scale=scales, interpret=True)


# ---- the engine -----------------------------------------------------------------------------

def fake_quantized_attention(q, k, v, cache, layer, meta, **kw):
    """The dense oracle reading K/V as an int8 cache holds them (numpy's rule, in jnp)."""
    def rt(x):
        xf = x.astype(jnp.float32)
        s = jnp.max(jnp.abs(xf), -1, keepdims=True) * jnp.float32(1 / 127)
        codes = jnp.clip(jnp.round(xf / jnp.where(s > 0, s, 1.0)), -127, 127)
        return (codes * s).astype(x.dtype)
    return dense_causal_attention(q, rt(k), rt(v), cache, layer, meta, **kw)


@functools.cache
def _dense_forward(model):
    module = model.module(attention=fake_quantized_attention)
    return jax.jit(lambda p, ids: module.apply(
        {"params": p}, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None])[0][0])


def dense_greedy(model, prompt, n):
    """Greedy by full recompute; ids padded to a multiple of 64 (causal: the padding cannot
    change earlier positions), so a few programs serve every length."""
    fwd, ids = _dense_forward(model), list(prompt)
    for _ in range(n):
        padded = np.zeros((1, -(-len(ids) // 64) * 64), np.int32)
        padded[0, :len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(fwd(model.params, jnp.asarray(padded)))[len(ids) - 1])))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def tiny():
    from models.random_init import random_model
    return random_model(TINY, seed=7)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, n).tolist() for n in (3, 17, 40, 9, 70)]  # 70: chunked


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas-interpret"])
def test_engine_int8_matches_dense_model_on_quantized_kv(tiny, prompts, backend):
    got = greedy(tiny, prompts, attention_backend=backend, kv_cache_dtype="int8")
    for prompt, tokens in zip(prompts, got):
        assert tokens == dense_greedy(tiny, prompt, 8)


def test_gpu_program_int8_writes_from_the_packed_qkv_and_matches_dense_model(
        tiny, prompts, monkeypatch):
    """The GPU program (fused linears: q/k/v come packed from one kernel) over an int8 cache:
    the KV-write kernel quantizes keys and values from the packed array (no split, no XLA
    quantize or scatter) and the Triton attention reads q in place; tokens equal the dense
    model reading the same quantized K/V."""
    from jaxserve.runtime import attention_backends, backends
    packed = []
    write = attention_backends.write_kv_cache_quantized

    def counted(caches, layer, slots, new, *, heads_at=None, **kw):
        packed.append(heads_at)
        return write(caches, layer, slots, new, heads_at=heads_at, **kw)
    monkeypatch.setattr(backends, "gpu_step", lambda: True)
    monkeypatch.setattr(attention_backends, "write_kv_cache_quantized", counted)
    got = greedy(tiny, prompts[:3], attention_backend="pallas-interpret",
                 linear_backend="pallas-interpret", kv_cache_dtype="int8")
    # Every step here (<= 64 tokens) runs the fused linears: packed q/k/v, keys after the 6
    # query heads, values after the 2 key heads.
    assert packed and set(packed) == {(6, 8)}, packed
    for prompt, tokens in zip(prompts, got):
        assert tokens == dense_greedy(tiny, prompt, 8)


LOGIT_SCALE = 5.0


# Even at 2 warpgroups a program, the engine's interpreted step stalled on this 2-thread
# XLA:CPU pool (0.6 s of CPU in 12 minutes; with NPROC=8 it runs in 35 s): run with the
# Mosaic attention's many-warpgroup cases, in a subprocess with a wide pool where this
# process's is narrow (test_ragged_paged_attention_mgpu.py).
@many_warpgroups
def test_engine_int8_on_the_mosaic_kernel_matches_xla_in_bf16(monkeypatch):
    """The GPU program with the Mosaic GPU attention kernel (GPU interpret mode) reading an
    int8 cache, bf16, against the engine's XLA int8 path on the same quantized K/V (itself
    checked against the dense oracle above): the same tokens up to the reference's first
    near-tie, logprobs close."""
    from jaxserve.runtime import attention_backends, backends
    from models.random_init import random_model
    calls = []
    mosaic = attention_backends.ragged_paged_attention_mgpu

    def counted(*a, **kw):
        calls.append(kw["k_scale"] is not None)
        return mosaic(*a, **kw)

    def triton(*a, **kw):
        raise AssertionError("the Triton attention kernel ran instead of the Mosaic GPU one")
    monkeypatch.setattr(backends, "gpu_step", lambda: True)
    monkeypatch.setattr(attention_backends, "ragged_paged_attention_mgpu", counted)
    monkeypatch.setattr(attention_backends, "ragged_paged_attention", triton)
    config = dataclasses.replace(TINY, num_heads=2)
    model = random_model(config, dtype="bfloat16", seed=7)
    # The random head's logits are flat (top-2 gaps under bf16's rounding from the first
    # token): scaled up, the greedy path has steps to compare.
    head = {"kernel": model.params["lm_head"]["kernel"] * LOGIT_SCALE}
    model = dataclasses.replace(model, params={**model.params, "lm_head": head})
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 19)]
    # Both rows at max_model_len 128 and a spare block, not the 1 GiB default: the
    # interpreter copies the cache operands into every warpgroup thread on each call.
    memory = (2 * 128 // 16 + 1) * 16 * config.kv_bytes_per_token(1, kv_quant.SCALE_BYTES)
    kw = dict(kv_cache_dtype="int8", dtype="bfloat16", layer_loop="unrolled",
              linear_backend="xla", kv_cache_memory=memory)
    want = greedy_top2(model, prompts, attention_backend="xla", **kw)
    got = greedy_top2(model, prompts, attention_backend="pallas-interpret",
                      gpu_kernels="mosaic", **kw)
    assert calls and all(calls)
    compared, worst = agree_before_near_ties(want, got)
    print(f"compared {compared} steps, chosen-token logprob difference <= {worst:.4f}")
    assert compared >= 4 and worst < BF16_NEAR_TIE / 2, (compared, worst)


def run_engine(model, prompts, **kw):
    """Greedy outputs (8 tokens each) and the engine's stats, with int8 KV on the XLA path."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="tiny", block_size=16, max_num_seqs=4,
                                    max_model_len=64, max_num_batched_tokens=64, warmup=False,
                                    kv_cache_dtype="int8", attention_backend="xla", **kw),
                       model=model)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))], engine.stats()


def test_engine_int8_prefix_caching_and_preemption_keep_outputs(tiny):
    # Three prompts sharing a 32-token prefix (two full blocks: prefix-cache hits, their codes
    # and scales reused) in a cache of 6 blocks, less than the 3 x 4 the sequences need
    # (preemption, recompute): outputs as with neither.
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, 256, 32).tolist()
    prompts = [prefix + rng.integers(1, 256, n).tolist() for n in (3, 9, 5)]
    base, _ = run_engine(tiny, prompts, enable_prefix_caching=False)
    per_block = 16 * TINY.kv_bytes_per_token(1, kv_quant.SCALE_BYTES)
    got, stats = run_engine(tiny, prompts, kv_cache_memory=per_block * 6)
    assert stats["prefix_cache_hits_blocks"] > 0 and stats["num_preemptions"] > 0, stats
    assert got == base


@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_engine_int8_sliding_window_and_softcap_match_dense_model(backend):
    # Gemma 2's attention: a window of 6 (shorter than the prompts), soft-caps, a query scale.
    from models.random_init import random_model
    from tp_worker import GEMMA2
    model = random_model(GEMMA2, seed=3)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 21, 40)]
    got = greedy(model, prompts, attention_backend=backend, kv_cache_dtype="int8")
    assert got == [dense_greedy(model, p, 8) for p in prompts]


def test_engine_int8_speculative_rollback_matches_dense_model(tiny):
    # n-gram drafts on repetitive prompts: rejected drafts' K/V (codes and scales) are rolled
    # back and rewritten; a small cache forces preemption too.
    from jaxserve import LLM, SamplingParams
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3] * 5, [40, 41, 42, 43] * 4]
    per_block = 8 * TINY.kv_bytes_per_token(1, kv_quant.SCALE_BYTES)
    llm = LLM(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1},
              max_num_seqs=3, max_model_len=64, max_num_batched_tokens=64, block_size=8,
              warmup=False, kv_cache_dtype="int8", attention_backend="xla",
              kv_cache_memory=9 * per_block)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(tiny, p, 16) for p in prompts]
    st = llm.stats()
    assert st["speculation"]["num_draft_tokens"] > st["speculation"]["num_accepted_tokens"] > 0
    assert st["num_preemptions"] > 0


@pytest.mark.model
def test_smollm2_int8_engine_matches_dense_model_on_quantized_kv(smollm2_fp32):
    # The real model: the engine's int8 cache (XLA path and the native kernel) gives the greedy
    # tokens of the dense model reading the same quantized K/V (what scripts/kv_quant_report.py
    # scores).
    tok = smollm2_fp32.tokenizer
    prompts = [[tok.bos_token_id] + tok.encode(t) if tok.add_bos else tok.encode(t)
               for t in ("The capital of France is", "def fibonacci(n):")]
    want = [dense_greedy(smollm2_fp32, p, 8) for p in prompts]
    for backend in ("xla", "cpu"):
        assert greedy(smollm2_fp32, prompts, attention_backend=backend,
                      kv_cache_dtype="int8") == want, backend


# ---- memory and config ------------------------------------------------------------------------

def test_memory_counts_the_scales():
    # SmolLM2: 2 * 30 layers * 3 KV heads * (64 codes + 4 scale bytes) per token.
    per_token = 2 * 30 * 3 * (64 * 1 + 4)
    assert SMOLLM2.kv_bytes_per_token(*kv_quant.bytes_per_element(jnp.int8)) == per_token == 12240
    assert SMOLLM2.kv_bytes_per_token(*kv_quant.bytes_per_element(jnp.float32)) == 46080
    assert SMOLLM2.kv_bytes_per_token(*kv_quant.bytes_per_element(jnp.bfloat16)) == 23040
    assert plan_num_blocks(SMOLLM2, 16, jnp.int8, per_token * 16 * 10 + 5) == 10
    # The cache the runner allocates holds exactly that many bytes.
    c = new_cache((30, 10, 16, 3, 64), jnp.int8)
    assert sum(x.nbytes for x in jax.tree.leaves(c)) == per_token * 16 * 10
    size = kv_size(SMOLLM2, 1, 100, "int8")
    assert size.bytes_per_token == per_token and size.total_bytes == 100 * per_token
    assert "2*30*3*64*1 + 2*30*3*4 (scales) = 12,240 bytes" in "\n".join(size.lines(SMOLLM2))
    assert kv_size(SMOLLM2, 1, 100, "float32").bytes_per_token == 46080
    assert KV_SIZE_SCALE_BYTES["int8"] == kv_quant.SCALE_BYTES  # the tool repeats the number


def test_config_accepts_int8_and_names_the_choices():
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    for bad in ("int4", "float16", "fp8", 8):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', "
                                             r"'float32', 'bfloat16', 'int8'\)"):
            EngineConfig(kv_cache_dtype=bad)


# ---- CUDA: lowering and sm_90a compiles ----------------------------------------------------------

def int8_shapes(model, block_size, dtype, tokens, rows, num_blocks=1024, num_pages=64,
                ragged=True):
    kv_heads, group, head_dim, layers = ATTENTION_MODELS[model]
    s = jax.ShapeDtypeStruct
    cache = s((layers, num_blocks, block_size, kv_heads, head_dim), jnp.int8)
    scales = s(cache.shape[:-1], jnp.float32)
    q = s((tokens, kv_heads * group, head_dim), dtype)
    lens = (s((rows + 1,), jnp.int32),) if ragged else ()
    return (q, cache, cache, s((), jnp.int32), s((rows, num_pages), jnp.int32), *lens,
            s((rows,), jnp.int32), scales, scales)


def _with_scales(kernel):
    def fn(*args):  # scales last: keyword arguments of the kernel
        *args, k_scale, v_scale = args
        return kernel(*args, k_scale=k_scale, v_scale=v_scale)
    return fn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_int8_kernels_lower_for_cuda(dtype):
    text = lower_for_h200(_with_scales(ragged_paged_attention),
                          *int8_shapes("smollm2", 16, dtype, 512, 16))
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" not in text
    text = lower_for_h200(_with_scales(paged_attention),
                          *int8_shapes("smollm2", 16, dtype, 64, 64, ragged=False))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("model,block_size,dtype,tokens,rows", [
    ("smollm2", 16, jnp.bfloat16, 64, 64), ("smollm2", 16, jnp.float32, 512, 16),
    ("llama3_8b", 32, jnp.bfloat16, 512, 16)])
def test_int8_ragged_kernel_compiles_for_sm90a(model, block_size, dtype, tokens, rows):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    compiled = compile_for_h200(_with_scales(ragged_paged_attention),
                                *int8_shapes(model, block_size, dtype, tokens, rows))
    assert "pallas_call" in compiled.as_text()


def test_int8_decode_kernel_compiles_for_sm90a():
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    compiled = compile_for_h200(_with_scales(paged_attention),
                                *int8_shapes("llama3_8b", 16, jnp.bfloat16, 64, 64, ragged=False))
    assert "pallas_call" in compiled.as_text()
