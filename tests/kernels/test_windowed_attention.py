"""Sliding-window, soft-capped and rescaled attention (the contract of attention_backends.py
`attend`) in every attention path, against a float64 numpy oracle: the XLA ragged path, the
Pallas ragged kernel and the decode kernel (interpreted on CPU, compiled on a GPU) and their
jnp references; the CUDA lowering of the windowed + capped kernels.

The grid covers windows smaller than the context (1, 5, 12, 20), soft-cap on and off, block
sizes that do not divide the window (8, 16 against 5, 12, 20), and splits / page steps that
start inside the window. Unused pages hold NaN (pallas_kernels/cases.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import step_layout
from jaxserve.runtime.attention import ragged_attention_xla
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200
from pallas_kernels.cases import attention_tolerance, paged_case, ragged_case
from tests.runtime.test_ragged_attention_xla import make_case as xla_case

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

LAYER = 1
MIX = dict(rows=[(0, 0), (1, 20), (2, 2), (3, 35), (5, 5), (17, 17), (40, 61), (1, 64)],
           head=3, tail=4)


def attend64(q, keys, values, qpos, kpos, window, softcap, scale):
    """float64: queries `[n, H, Dh]` at qpos over keys/values `[S, H, Dh]` at kpos."""
    s = np.einsum("nhd,shd->hns", q, keys) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    seen = kpos[None, :] <= qpos[:, None]
    if window is not None:
        seen &= kpos[None, :] > qpos[:, None] - window
    s = np.where(seen[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hns,shd->nhd", p, values)


def ragged_oracle(q, k, v, layer, table, qs, lens, window, softcap, scale):
    """Per row: its keys gathered from its pages; the output `[T, H, Dh]` and owned `[T]`."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    table, qs, lens = (np.asarray(x) for x in (table, qs, lens))
    bs, group = k.shape[2], q.shape[1] // k.shape[3]
    out, owned = np.zeros_like(q), np.zeros(q.shape[0], bool)
    for r in range(len(lens)):
        q_len, ctx = qs[r + 1] - qs[r], lens[r]
        if q_len == 0:
            continue
        pos = np.arange(ctx)
        keys = np.repeat(k[layer, table[r, pos // bs], pos % bs], group, axis=1)
        vals = np.repeat(v[layer, table[r, pos // bs], pos % bs], group, axis=1)
        span = slice(qs[r], qs[r] + q_len)
        out[span] = attend64(q[span], keys, vals, ctx - q_len + np.arange(q_len), pos, window,
                             softcap, scale)
        owned[span] = True
    return out, owned


# (dtype, block_size, window, softcap, queries_per_tile, num_splits, pages_per_step)
KERNEL_CASES = [
    ("f32", 8, 12, 3.0, 8, None, None),
    ("f32", 16, 5, None, None, 16, None),  # more splits than pages: most see nothing
    ("f32", 8, 20, 2.0, 4, 3, 2),          # splits end mid-step, windows start mid-split
    ("f32", 8, 1, None, None, None, None),  # only the query's own key
    ("bf16", 16, 12, 5.0, None, None, None),
    ("f32", 8, None, 3.0, 8, None, None),   # soft-cap alone
]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _ragged(seed, dtype, block_size, group=3, head_dim=64):
    pages = max(-(-c // block_size) for _, c in MIX["rows"]) + 1
    return ragged_case(seed, dtype=dtype, block_size=block_size, num_kv_heads=2, group=group,
                       head_dim=head_dim, num_pages=pages, num_layers=2, live_layers=[LAYER],
                       **MIX)


def _check(out, want, owned, dtype):
    out = np.asarray(out, np.float32)
    assert np.isfinite(out[owned]).all()
    np.testing.assert_allclose(out[owned], want[owned], **attention_tolerance(dtype))


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ragged_kernel_and_reference(case, interpret):
    dtype, bs, window, softcap, bq, splits, step = case
    dtype = DTYPES[dtype]
    q, k, v, pt, qs, cl = _ragged(0, dtype, bs)
    scale = 0.2  # a query_pre_attn_scalar-style scale, not 1 / sqrt(Dh)
    want, owned = ragged_oracle(q, k, v, LAYER, pt, qs, cl, window, softcap, scale)
    w = None if window is None else jnp.int32(window)  # traced, as the engine's layer windows
    out = ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, window=w, softcap=softcap,
                                 sm_scale=scale, queries_per_tile=bq, num_splits=splits,
                                 pages_per_step=step, interpret=interpret)
    _check(out, want, owned, dtype)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, softcap=softcap,
                                    sm_scale=scale))(q, k, v, LAYER, pt, qs, cl, window=w)
    _check(ref, want, owned, dtype)


def test_ragged_kernel_window_traced_in_scan(interpret):
    """Per-layer windows as an array indexed by the scanned layer: one program, both layers."""
    q, k, v, pt, qs, cl = ragged_case(3, dtype=jnp.float32, block_size=8, num_kv_heads=2,
                                      group=2, head_dim=64, num_pages=9, num_layers=2,
                                      live_layers=None, **MIX)
    windows = jnp.asarray([5, 1 << 30], jnp.int32)  # local, global

    @jax.jit
    def both(q, k, v):
        def step(carry, layer):
            return carry, ragged_paged_attention(q, k, v, layer, pt, qs, cl,
                                                 window=windows[layer], interpret=interpret)
        return jax.lax.scan(step, None, jnp.arange(2, dtype=jnp.int32))[1]

    outs = both(q, k, v)
    for layer, window in ((0, 5), (1, None)):
        want, owned = ragged_oracle(q, k, v, layer, pt, qs, cl, window, None, 64 ** -0.5)
        _check(outs[layer], want, owned, jnp.float32)


@pytest.mark.parametrize("window,softcap,block_size", [(12, 3.0, 8), (5, None, 16),
                                                       (20, 2.0, 8), (1, None, 8)])
def test_decode_kernel_and_reference(window, softcap, block_size, interpret):
    lens = [1, 9, 16, 17, 33, 64]
    q, k, v, pt, cl = paged_case(1, dtype=jnp.float32, block_size=block_size, num_kv_heads=2,
                                 group=4, head_dim=64, lens=lens,
                                 num_pages=-(-64 // block_size) + 1, live_layers=[LAYER])
    qs = np.arange(len(lens) + 1, dtype=np.int32)  # one query per row
    want, owned = ragged_oracle(q, k, v, LAYER, pt, qs, cl, window, softcap, 64 ** -0.5)
    out = paged_attention(q, k, v, LAYER, pt, cl, window=jnp.int32(window), softcap=softcap,
                          pages_per_split=2, interpret=interpret)
    _check(out, want, owned, jnp.float32)
    ref = paged_attention_reference(q, k, v, LAYER, pt, cl, window=window, softcap=softcap)
    _check(ref, want, owned, jnp.float32)


# merge: the decode dots' two layouts (attention.py), each on half the cases.
@pytest.mark.parametrize("query_lens,starts,block_size,window,softcap,merge", [
    ([1, 1, 1], [0, 5, 40], 8, 5, None, True),             # decodes
    ([1, 1, 1], [0, 5, 40], 8, 5, 3.0, False),
    ([37], [0], 8, 12, 3.0, True),                           # one prefill, window < context
    ([20], [33], 16, 12, None, False),                       # a later chunk
    ([3, 1, 17, 1, 2, 5], [9, 0, 4, 30, 50, 0], 4, 7, 2.0, True),  # a mix with gaps
    ([3, 1, 17, 1, 2, 5], [9, 0, 4, 30, 50, 0], 4, 7, None, False),
])
def test_xla_ragged_path(query_lens, starts, block_size, window, softcap, merge):
    heads, kv_heads, dh, scale = 4, 2, 32, 0.3
    rng, rows, tables, tokens, num_blocks = xla_case(
        0, query_lens, starts, block_size=block_size, heads=heads, kv_heads=kv_heads)
    lay = step_layout.build(rows, tables, tokens=tokens, max_num_seqs=8, block_size=block_size,
                            idle_slot=8, ragged=True)
    k_cache = rng.standard_normal((2, num_blocks, block_size, kv_heads, dh)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    q = rng.standard_normal((1, tokens, heads, dh)).astype(np.float32)
    k, v = (rng.standard_normal((1, tokens, kv_heads, dh)).astype(np.float32) for _ in "kv")
    meta = PagedMeta(positions=lay.positions[None], slots=lay.write_slots[None],
                     query_start=lay.query_start, context_lens=lay.context_lens,
                     page_table=np.zeros((len(lay.context_lens), 1), np.int32), pairs=lay.pairs,
                     num_pairs=lay.num_pairs, multi=lay.multi, chunk_pages=lay.chunk_pages)
    fn = jax.jit(lambda q, k, v, c, m, w: ragged_attention_xla(
        q, k, v, c, jnp.int32(LAYER), m, merge, window=w, softcap=softcap, scale=scale))
    out, cache = fn(q, k, v, KVCache(k=jnp.asarray(k_cache), v=jnp.asarray(v_cache)), meta,
                    jnp.int32(window))
    kw, vw = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
    order = [rows[i] for i in np.argsort(lay.row_index)]
    for i, row in enumerate(order):
        n, table = len(row.tokens), tables[row.slot]
        span = slice(lay.query_start[i], lay.query_start[i] + n)
        pos = np.arange(row.start + n)
        keys = np.repeat(kw[LAYER, table[pos // block_size], pos % block_size], 2, axis=1)
        vals = np.repeat(vw[LAYER, table[pos // block_size], pos % block_size], 2, axis=1)
        want = attend64(np.asarray(q[0, span], np.float64), keys, vals,
                        row.start + np.arange(n), pos, window, softcap, scale)
        np.testing.assert_allclose(np.asarray(out[0, span]), want, rtol=2e-5, atol=2e-5)


# The engine's Gemma-2-like shapes: head_dim 128, 8 KV heads x 2, a windowed + capped layer.
def _engine_shapes(dtype, tokens, rows, block_size=16):
    s = jax.ShapeDtypeStruct
    cache = s((4, 512, block_size, 8, 128), dtype)
    return (s((tokens, 16, 128), dtype), cache, cache, s((), jnp.int32), s((rows, 64), jnp.int32),
            s((rows + 1,), jnp.int32), s((rows,), jnp.int32), s((), jnp.int32))


def _windowed_kernel(q, k, v, layer, pt, qs, cl, window):
    return ragged_paged_attention(q, k, v, layer, pt, qs, cl, window=window, softcap=50.0,
                                  sm_scale=256 ** -0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_windowed_capped_kernel_lowers_for_cuda(dtype):
    text = lower_for_h200(_windowed_kernel, *_engine_shapes(dtype, 512, 16))
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" not in text


def test_windowed_capped_kernel_compiles_for_sm90a():
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    compiled = compile_for_h200(_windowed_kernel, *_engine_shapes(jnp.bfloat16, 64, 64))
    assert "pallas_call" in compiled.as_text()
