"""The XLA ragged attention (the CPU path) against a float64 numpy oracle, over step layouts
built by step_layout.build from mixes of decode rows, prefill chunks and k-query rows, with a
float32 and a bfloat16 cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import step_layout
from jaxserve.runtime.attention import ragged_attention_xla
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from jaxserve.runtime.step_layout import Row


def oracle(q, k_cache, v_cache, layer, rows, tables, block_size):
    """Per (row, its queries' flat slice): keys = the row's positions [0, start + n) gathered
    from its pages (the cache after this step's writes); query i sees keys at positions
    <= start + i. float64."""
    outs = []
    for (row, qslice), table in zip(rows, tables):
        n = len(row.tokens)
        end = row.start + n
        pos = np.arange(end)
        blocks = np.asarray(table)[pos // block_size]
        keys = np.asarray(k_cache[layer], np.float64)[blocks, pos % block_size]  # [S, K, Dh]
        vals = np.asarray(v_cache[layer], np.float64)[blocks, pos % block_size]
        qr = np.asarray(q[qslice], np.float64)  # [n, H, Dh]
        h, kh = qr.shape[1], keys.shape[1]
        kk = np.repeat(keys, h // kh, axis=1)  # [S, H, Dh]
        vv = np.repeat(vals, h // kh, axis=1)
        s = np.einsum("nhd,shd->hns", qr, kk) / np.sqrt(qr.shape[-1])
        s = np.where(pos[None, None] <= (row.start + np.arange(n))[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append(np.einsum("hns,shd->nhd", p, vv))
    return outs


def make_case(seed, query_lens, starts, *, block_size, heads, kv_heads, num_slots=8):
    rng = np.random.default_rng(seed)
    max_blocks = max(-(-(s + n) // block_size) for n, s in zip(query_lens, starts)) + 1
    num_blocks = 1 + num_slots * max_blocks
    tables = np.zeros((num_slots + 1, max_blocks), np.int32)  # the last: the idle slot
    free = list(rng.permutation(np.arange(1, num_blocks)))
    rows = []
    for slot, (n, start) in enumerate(zip(query_lens, starts)):
        need = -(-(start + n) // block_size)
        tables[slot, :need] = [free.pop() for _ in range(need)]
        rows.append(Row(slot=slot, start=start, tokens=[1] * n, samples=True))
    t_needed = step_layout.flat_tokens_needed(query_lens)
    tokens = max(t_needed, 16) if any(n > 1 for n in query_lens) else t_needed
    return rng, rows, tables, tokens, num_blocks


# A bf16 cache: q, k, v and the probabilities are rounded to bf16 before the dots (f32 sums).
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("query_lens,starts,block_size,heads,kv_heads", [
    ([1, 1, 1], [0, 5, 40], 8, 4, 2),                    # decodes only
    ([1, 1, 1, 1], [0, 3, 17, 60], 1, 4, 2),             # block size 1: a pair per key
    ([37], [0], 8, 4, 1),                                # one prefill from position 0
    ([20], [33], 16, 6, 2),                              # a later chunk
    ([3, 1, 17, 1, 2, 5], [9, 0, 4, 30, 50, 0], 4, 4, 4),  # a mix, k-query rows, gaps
    ([1, 16, 1], [63, 0, 12], 16, 3, 1),                 # exactly one chunk
])
def test_ragged_attention_matches_oracle(query_lens, starts, block_size, heads, kv_heads, merge,
                                         cache_dtype):
    rng, rows, tables, tokens, num_blocks = make_case(
        0, query_lens, starts, block_size=block_size, heads=heads, kv_heads=kv_heads)
    dh, layers, layer = 32, 2, 1
    lay = step_layout.build(rows, tables, tokens=tokens, max_num_seqs=8, block_size=block_size,
                            idle_slot=8, ragged=True)
    dt = jnp.dtype(cache_dtype)

    def rounded(shape):  # values the cache's dtype holds exactly
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dt), np.float32)

    k_cache = rounded((layers, num_blocks, block_size, kv_heads, dh))
    v_cache = rounded(k_cache.shape)
    t = tokens
    q, k, v = rounded((1, t, heads, dh)), rounded((1, t, kv_heads, dh)), rounded((1, t, kv_heads, dh))
    meta = PagedMeta(positions=lay.positions[None], slots=lay.write_slots[None],
                     query_start=lay.query_start, context_lens=lay.context_lens,
                     page_table=np.zeros((len(lay.context_lens), 1), np.int32), pairs=lay.pairs,
                     num_pairs=lay.num_pairs, multi=lay.multi, chunk_pages=lay.chunk_pages)
    fn = jax.jit(lambda q, k, v, c, m: ragged_attention_xla(q, k, v, c, jnp.int32(layer), m,
                                                            merge))
    out, cache = fn(q, k, v, KVCache(k=jnp.asarray(k_cache, dt), v=jnp.asarray(v_cache, dt)),
                    meta)
    assert out.dtype == jnp.float32 and cache.k.dtype == dt
    # The oracle reads the cache as written by this step (the writes are checked too).
    kw, vw = k_cache.copy(), v_cache.copy()
    written = lay.write_slots
    real = lay.token_slot != 8
    kw[layer, written[real] // block_size, written[real] % block_size] = k[0, real]
    vw[layer, written[real] // block_size, written[real] % block_size] = v[0, real]
    # Block 0 (the null block) takes the idle tokens' writes: anything.
    np.testing.assert_array_equal(np.asarray(cache.k, np.float32)[:, 1:], kw[:, 1:])
    np.testing.assert_array_equal(np.asarray(cache.v, np.float32)[:, 1:], vw[:, 1:])
    order = [rows[i] for i in np.argsort(lay.row_index)]
    spans = [slice(lay.query_start[i], lay.query_start[i] + len(r.tokens))
             for i, r in enumerate(order)]
    want = oracle(q[0], kw, vw, layer, [(r, s) for r, s in zip(order, spans)],
                  [tables[r.slot] for r in order], block_size)
    got = np.asarray(out[0])
    tol = TOL[cache_dtype]
    for span, w in zip(spans, want):
        np.testing.assert_allclose(got[span], w, rtol=tol, atol=tol)
