"""The XLA paged attention paths (padded page table and flat block list) against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.attention import paged_attention_xla
from jaxserve.runtime.kv_cache import KVCache, PagedMeta


def numpy_attention(q, keys, values):
    """q [H, Dh], keys/values [S, K, Dh] -> [H, Dh], float64, grouped-query."""
    h, dh = q.shape
    kh = keys.shape[1]
    g = h // kh
    out = np.zeros((h, dh))
    for i in range(h):
        s = keys[:, i // g] @ q[i] / np.sqrt(dh)
        p = np.exp(s - s.max())
        out[i] = (p / p.sum()) @ values[:, i // g]
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
# merge_kv_heads only changes the ragged (flat block list) path.
@pytest.mark.parametrize("ragged,merge", [(False, True), (True, True), (True, False)])
def test_decode_matches_numpy(block_size, ragged, cache_dtype, merge):
    """fp32 q against an fp32 or bf16 cache; the numpy reference reads the cache as stored, so
    with bf16 the only extra error is the kernel's bf16 q and probabilities (8-bit mantissa)."""
    rng = np.random.default_rng(block_size)
    layers, nblocks, kh, g, dh = 2, 64, 2, 3, 16
    k = rng.standard_normal((layers, nblocks, block_size, kh, dh)).astype(np.float32)
    v = rng.standard_normal((layers, nblocks, block_size, kh, dh)).astype(np.float32)
    lens = np.array([1, 2 * block_size + 1, 5, 3 * block_size], np.int32)
    b = lens.size
    need = -(-lens // block_size)
    perm = rng.permutation(np.arange(1, nblocks))  # shuffled, never the null block
    width = int(need.max())
    table = np.zeros((b, width), np.int32)
    start = 0
    for r in range(b):
        table[r, :need[r]] = perm[start:start + need[r]]
        start += need[r]
    q = rng.standard_normal((b, 1, kh * g, dh)).astype(np.float32)
    new_k = rng.standard_normal((b, 1, kh, dh)).astype(np.float32)
    new_v = rng.standard_normal((b, 1, kh, dh)).astype(np.float32)
    pos = lens - 1
    slots = (table[np.arange(b), pos // block_size] * block_size + pos % block_size)[:, None]
    flat = None
    if ragged:
        rows = np.repeat(np.arange(b), need)
        first = np.concatenate([np.arange(n) for n in need])
        flat = np.zeros((3, rows.size + 3), np.int32)  # 3 padding entries
        flat[2] = 1 << 29
        flat[:, :rows.size] = [table[rows, first], rows, first * block_size]
    meta = PagedMeta(positions=pos[:, None], slots=slots.astype(np.int32),
                     page_table=table if not ragged else np.zeros((b, 1), np.int32),
                     context_lens=lens, ragged=flat)
    cache = KVCache(k=jnp.asarray(k, cache_dtype), v=jnp.asarray(v, cache_dtype))
    attention = functools.partial(paged_attention_xla, merge_kv_heads=merge)
    out, cache = jax.jit(attention)(q, new_k, new_v, cache, 1, meta)
    ck, cv = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
    for r in range(b):
        ctx_k = ck[1, table[r, :need[r]]].reshape(-1, kh, dh)[:lens[r]]
        ctx_v = cv[1, table[r, :need[r]]].reshape(-1, kh, dh)[:lens[r]]
        stored = np.asarray(jnp.asarray(new_k[r, 0], cache_dtype), np.float64)
        np.testing.assert_array_equal(ctx_k[-1], stored)  # the write landed
        tol = 1e-5 if cache_dtype == "float32" else 2e-2
        np.testing.assert_allclose(np.asarray(out)[r, 0], numpy_attention(q[r, 0], ctx_k, ctx_v),
                                   rtol=tol, atol=tol)
    assert out.dtype == jnp.float32 and cache.k.dtype == jnp.dtype(cache_dtype)
    np.testing.assert_array_equal(np.asarray(cache.k, np.float32)[0],
                                  np.asarray(jnp.asarray(k[0], cache_dtype), np.float32))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_prefill_chunk_matches_numpy(cache_dtype):
    """A later prefill chunk (T tokens after `start` cached ones, plus 3 padding tokens that
    write into the null block) attends causally over the paged context."""
    rng = np.random.default_rng(7)
    layers, nblocks, bs, kh, g, dh = 2, 16, 4, 2, 3, 16
    start, t, pad = 6, 7, 3
    k = rng.standard_normal((layers, nblocks, bs, kh, dh)).astype(np.float32)
    v = rng.standard_normal((layers, nblocks, bs, kh, dh)).astype(np.float32)
    need = -(-(start + t) // bs)
    table = rng.permutation(np.arange(1, nblocks))[:need].astype(np.int32)[None]  # [1, nb]
    pos = np.arange(start, start + t)
    positions = np.concatenate([pos, np.full(pad, pos[-1])]).astype(np.int32)[None]
    slots = np.zeros((1, t + pad), np.int32)
    slots[0, :t] = table[0, pos // bs] * bs + pos % bs
    q = rng.standard_normal((1, t + pad, kh * g, dh)).astype(np.float32)
    new_k = rng.standard_normal((1, t + pad, kh, dh)).astype(np.float32)
    new_v = rng.standard_normal((1, t + pad, kh, dh)).astype(np.float32)
    meta = PagedMeta(positions=positions, slots=slots, page_table=table,
                     context_lens=np.array([start + t], np.int32))
    cache = KVCache(k=jnp.asarray(k, cache_dtype), v=jnp.asarray(v, cache_dtype))
    out, cache = jax.jit(paged_attention_xla)(q, new_k, new_v, cache, 1, meta)
    ctx_k = np.asarray(cache.k, np.float64)[1, table[0]].reshape(-1, kh, dh)
    ctx_v = np.asarray(cache.v, np.float64)[1, table[0]].reshape(-1, kh, dh)
    stored = np.asarray(jnp.asarray(new_k[0, :t], cache_dtype), np.float64)
    np.testing.assert_array_equal(ctx_k[start:start + t], stored)
    tol = 1e-5 if cache_dtype == "float32" else 2e-2
    for i, p in enumerate(pos):
        np.testing.assert_allclose(np.asarray(out)[0, i],
                                   numpy_attention(q[0, i], ctx_k[:p + 1], ctx_v[:p + 1]),
                                   rtol=tol, atol=tol)
