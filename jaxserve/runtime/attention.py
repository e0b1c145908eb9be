"""Attention backends on the paged KV cache. This is the pure-XLA one (CPU path and oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.runtime.kv_cache import KVCache, PagedMeta

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


def ragged_decode_attention(q, cache: KVCache, layer, meta: PagedMeta,
                           merge_kv_heads: bool = True):
    """Decode attention over the flat list of blocks in use, `meta.ragged` `[3, P]`.

    Gathering `[B, n_blocks]` pages pads every row to the longest context in the batch, and on
    a CPU that gather's memory traffic is the decode step's largest cost. Here each block in use
    is gathered once; a softmax across each row's blocks is assembled with segment reductions.

    Each block's `[BS, K, Dh]` tile is used as one `[BS * K, Dh]` matrix against all H query
    heads of its row, and scores of a head against another KV head's tokens are masked. That
    does K times the (tiny) dot work, but it is one dot per block with no transpose of the
    gathered tile: XLA:CPU runs a batched dot as a loop over its batch, and P*K [G, Dh] x
    [Dh, BS] products cost far more in loop overhead than they save (scripts/profile_step.py,
    docs/perf_attention.md: 30 layers at P=2048, 1.3x faster in fp32).
    Under tensor parallelism (K split over devices by sharding annotations) merging K into the
    token axis would make XLA all-gather the cache: `merge_kv_heads=False` keeps K a batch axis.
    q `[B, 1, H, Dh]`; returns `[B, 1, H, Dh]`.
    """
    if not merge_kv_heads:
        return _ragged_decode_attention_per_kv_head(q, cache, layer, meta)
    b, _, h, dh = q.shape
    blocks, rows, starts = meta.ragged[0], meta.ragged[1], meta.ragged[2]  # [P] each
    p = blocks.shape[0]
    _, _, bs, kh, _ = cache.k.shape
    keys = cache.k[layer, blocks].reshape(p, bs * kh, dh)  # [P, T = BS*K, Dh], t = s*K + k
    values = cache.v[layer, blocks].reshape(p, bs * kh, dh)
    qp = q[:, 0][rows].astype(keys.dtype)  # [P, H, Dh]
    scores = jnp.einsum("PHD,PTD->PHT", qp, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    t = jnp.arange(bs * kh, dtype=jnp.int32)  # [T]
    own = (jnp.arange(h, dtype=jnp.int32) // (h // kh))[:, None] == (t % kh)[None]  # [H, T]
    pos = starts[:, None] + t[None] // kh  # [P, T]
    visible = (pos < meta.context_lens[rows][:, None])[:, None] & own[None]  # [P, H, T]
    scores = jnp.where(visible, scores, MASK_VALUE)
    row_max = jax.ops.segment_max(scores.max(-1), rows, num_segments=b)  # [B, H]
    # Masked entries must be exactly 0: another head's tokens are summed over in the PV dot.
    probs = jnp.where(visible, jnp.exp(scores - row_max[rows][..., None]), 0.0)  # [P, H, T]
    denom = jax.ops.segment_sum(probs.sum(-1), rows, num_segments=b)  # [B, H]
    out = jnp.einsum("PHT,PTD->PHD", probs.astype(values.dtype), values,
                     preferred_element_type=jnp.float32)
    # Idle batch rows own no blocks: keep them finite (0) rather than 0 / 0.
    out = jax.ops.segment_sum(out, rows, num_segments=b) / jnp.maximum(denom, 1e-30)[..., None]
    return out.reshape(b, 1, h, dh).astype(q.dtype)


def _ragged_decode_attention_per_kv_head(q, cache: KVCache, layer, meta: PagedMeta):
    """ragged_decode_attention with one `[G, Dh] x [Dh, BS]` dot per (block, KV head)."""
    b, _, h, dh = q.shape
    blocks, rows, starts = meta.ragged[0], meta.ragged[1], meta.ragged[2]  # [P] each
    keys, values = cache.k[layer, blocks], cache.v[layer, blocks]  # [P, BS, K, Dh]
    bs, kh = keys.shape[1], keys.shape[2]
    qp = q[:, 0].reshape(b, kh, h // kh, dh)[rows].astype(keys.dtype)  # [P, K, G, Dh]
    scores = jnp.einsum("PKGD,PSKD->PKGS", qp, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    pos = starts[:, None] + jnp.arange(bs, dtype=jnp.int32)  # [P, BS]
    visible = pos < meta.context_lens[rows][:, None]  # [P, BS]
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    row_max = jax.ops.segment_max(scores.max(-1), rows, num_segments=b)  # [B, K, G]
    probs = jnp.exp(scores - row_max[rows][..., None])  # [P, K, G, BS]
    denom = jax.ops.segment_sum(probs.sum(-1), rows, num_segments=b)  # [B, K, G]
    out = jnp.einsum("PKGS,PSKD->PKGD", probs.astype(values.dtype), values,
                     preferred_element_type=jnp.float32)
    out = jax.ops.segment_sum(out, rows, num_segments=b) / jnp.maximum(denom, 1e-30)[..., None]
    return out.reshape(b, 1, h, dh).astype(q.dtype)


def paged_attention_xla(q, k, v, cache: KVCache, layer, meta: PagedMeta,
                        merge_kv_heads: bool = True):
    """Writes this step's k/v into the cache, then attends over each row's paged context.

    q `[B, T, H, Dh]`, k/v `[B, T, K, Dh]`; returns `[B, T, H, Dh]` and the updated cache.
    Serves decode (T = 1, B = batch slots) and prefill chunks (B = 1, T = chunk) alike.
    """
    cache = write_kv(cache, layer, k, v, meta.slots)
    if meta.ragged is not None:
        return ragged_decode_attention(q, cache, layer, meta, merge_kv_heads), cache
    keys, values = gather_context(cache, layer, meta.page_table)  # [B, S, K, Dh]
    b, t, h, dh = q.shape
    kh = keys.shape[2]
    # In the cache's dtype: with a bf16 cache both dots run bf16 x bf16 -> f32 (AMX on CPU)
    # instead of promoting the gathered K/V to f32.
    qg = q.reshape(b, t, kh, h // kh, dh).astype(keys.dtype)  # [B, T, K, G, Dh]
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", qg, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)  # [S]
    visible = (key_pos[None, None, :] <= meta.positions[:, :, None]) & \
        (key_pos[None, None, :] < meta.context_lens[:, None, None])  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype), cache
