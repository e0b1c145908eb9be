"""Attention backends on the paged KV cache. This is the pure-XLA one (CPU path and oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kv_cache import KVCache, PagedMeta

# Finite so that a row with nothing to attend to (an empty batch slot) gives finite garbage
# instead of NaN from softmax over all -inf.
MASK_VALUE = -1e30


def write_kv(cache: KVCache, layer, k, v, slots) -> KVCache:
    """Scatters k/v `[B, T, K, Dh]` into `layer` at flat `slots` `[B, T]`."""
    block_size = cache.k.shape[2]
    blk, off = slots // block_size, slots % block_size
    return KVCache(k=cache.k.at[layer, blk, off].set(k.astype(cache.k.dtype)),
                   v=cache.v.at[layer, blk, off].set(v.astype(cache.v.dtype)))


def gather_context(cache: KVCache, layer, page_table):
    """Each row's context `[B, n_blocks * block_size, K, Dh]` (keys and values)."""
    b, nb = page_table.shape
    _, _, bs, kh, dh = cache.k.shape
    keys = cache.k[layer, page_table].reshape(b, nb * bs, kh, dh)
    values = cache.v[layer, page_table].reshape(b, nb * bs, kh, dh)
    return keys, values


def paged_attention_xla(q, k, v, cache: KVCache, layer, meta: PagedMeta):
    """Writes this step's k/v into the cache, then attends over each row's paged context.

    q `[B, T, H, Dh]`, k/v `[B, T, K, Dh]`; returns `[B, T, H, Dh]` and the updated cache.
    Serves decode (T = 1, B = batch slots) and prefill chunks (B = 1, T = chunk) alike.
    """
    cache = write_kv(cache, layer, k, v, meta.slots)
    keys, values = gather_context(cache, layer, meta.page_table)  # [B, S, K, Dh]
    b, t, h, dh = q.shape
    kh = keys.shape[2]
    qg = q.reshape(b, t, kh, h // kh, dh)  # [B, T, K, G, Dh]
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", qg, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)  # [S]
    visible = (key_pos[None, None, :] <= meta.positions[:, :, None]) & \
        (key_pos[None, None, :] < meta.context_lens[:, None, None])  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype), cache
