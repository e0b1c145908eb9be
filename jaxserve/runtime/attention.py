"""Attention backends on the paged KV cache. This is the pure-XLA one (CPU path and oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runtime import kv_quant
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from jaxserve.runtime.step_layout import QUERY_CHUNK, kv_tile_blocks, pair_tile

# Finite so that a row with nothing to attend to (an empty batch slot) gives finite garbage
# instead of NaN from softmax over all -inf.
MASK_VALUE = -1e30


def write_kv(cache: KVCache, layer, k, v, slots) -> KVCache:
    """Scatters k/v `[B, T, K, Dh]` into `layer` at flat `slots` `[B, T]` (an int8 cache:
    quantized per token and KV head, codes and scales written alike)."""
    block_size = cache.k.shape[2]
    blk, off = slots // block_size, slots % block_size
    if cache.quantized:
        (kc, ks), (vc, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
        return KVCache(k=cache.k.at[layer, blk, off].set(kc),
                       v=cache.v.at[layer, blk, off].set(vc),
                       k_scale=cache.k_scale.at[layer, blk, off].set(ks),
                       v_scale=cache.v_scale.at[layer, blk, off].set(vs))
    return KVCache(k=cache.k.at[layer, blk, off].set(k.astype(cache.k.dtype)),
                   v=cache.v.at[layer, blk, off].set(v.astype(cache.v.dtype)))


def _compute_dtype(q, cache: KVCache):
    """The dtype the dots read: the cache's (q cast to it), or q's for an int8 cache, whose
    codes convert exactly to bf16 and f32 (|code| <= 127 < 2^8)."""
    return q.dtype if cache.quantized else cache.k.dtype


def _pages(cache: KVCache, layer, blocks, dtype):
    """K and V of `blocks` (any shape B) as (keys, values, key scales, value scales):
    `[*B, BS, K, Dh]` in dtype and `[*B, BS, K]` float32, or None scales for a float cache.
    An int8 cache's scales are applied to the scores and probabilities, not to the codes."""
    keys, values = cache.k[layer, blocks], cache.v[layer, blocks]
    if not cache.quantized:
        return keys, values, None, None
    return (keys.astype(dtype), values.astype(dtype), cache.k_scale[layer, blocks],
            cache.v_scale[layer, blocks])


def ragged_attention_xla(q, k, v, cache: KVCache, layer, meta: PagedMeta,
                        merge_kv_heads: bool = True, *, window=None, softcap=None, scale=None):
    """Writes this step's k/v into the cache, then attends for every flat token of the step.

    q `[1, T, H, Dh]`, k/v `[1, T, K, Dh]`; returns `[1, T, H, Dh]` and the updated cache.
    Single-query rows (decodes) attend over the flat list of (query, block) pairs, so no row
    pays for the longest context; multi-query rows (prefill chunks) attend in aligned chunks of
    QUERY_CHUNK queries over key tiles of their row's pages. Both loop over tiles with an online
    softmax, with a trip count set by the step's data: one compiled program per token bucket
    serves any mix of rows and context lengths.

    window (int32 scalar, may be traced: the layer's), softcap, scale: the attention contract of
    models/llama.py `dense_causal_attention`; a query at p sees keys in (p - window, p].
    """
    cache = write_kv(cache, layer, k, v, meta.slots)
    qf = q[0]  # [T, H, Dh]
    logits = _Logits(window, softcap, scale)
    out = _single_query_attention(qf, cache, layer, meta, merge_kv_heads, logits)
    if qf.shape[0] >= QUERY_CHUNK:  # smaller steps hold no multi-query row
        chunked = _chunked_attention(qf, cache, layer, meta, logits)
        out = jnp.where(meta.multi[:, None, None], chunked, out)
    return out[None].astype(q.dtype), cache


class _Logits:
    """Scale, soft-cap and window of one layer's logits (all optional)."""

    def __init__(self, window, softcap, scale):
        self.window, self.softcap, self.scale = window, softcap, scale

    def scaled(self, scores, head_dim: int):
        scale = self.scale if self.scale is not None else 1.0 / jnp.sqrt(jnp.float32(head_dim))
        scores = scores * jnp.float32(scale)
        return scores if self.softcap is None else self.softcap * jnp.tanh(scores / self.softcap)

    def visible(self, kpos, qpos):
        """Causal (and windowed) visibility of keys at kpos from queries at qpos (broadcast)."""
        seen = kpos <= qpos
        return seen if self.window is None else seen & (kpos > qpos - self.window)


def _online_update(carry, scores, visible, values, segments, num_segments, pv_dims,
                   value_scales=None):
    """One tile of a segment-wise online softmax. carry (m, l, acc) per segment.
    value_scales (int8 cache): broadcast against p, they weight the probabilities of the PV dot
    (sum_s p_s * scale_s * code_s is p @ dequantized values)."""
    m, l, acc = carry
    scores = jnp.where(visible, scores, MASK_VALUE)
    tile_max = jax.ops.segment_max(scores.max(-1), segments, num_segments=num_segments)
    m_new = jnp.maximum(m, tile_max)
    # Masked entries must be exactly 0: the PV dot sums over them.
    p = jnp.where(visible, jnp.exp(scores - m_new[segments][..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jax.ops.segment_sum(p.sum(-1), segments, num_segments=num_segments)
    # A slot no query sees may hold any scale, NaN included: where, not a product with p = 0.
    pw = p if value_scales is None else jnp.where(visible, p * value_scales, 0.0)
    pv = jnp.einsum(pv_dims, pw.astype(values.dtype), values, preferred_element_type=jnp.float32)
    acc = acc * corr[..., None] + jax.ops.segment_sum(pv, segments, num_segments=num_segments)
    return m_new, l, acc


def _single_query_attention(q, cache: KVCache, layer, meta: PagedMeta, merge_kv_heads: bool,
                            logits: _Logits):
    """Attention of each single-query token over its (query, block) pairs: `[T, H, Dh]`.

    merge_kv_heads: each block's `[BS, K, Dh]` tile is used as one `[BS * K, Dh]` matrix against
    all H query heads, scores against another KV head's tokens masked. That does K times the
    (tiny) dot work but is one dot per block with no transpose: XLA:CPU runs a batched dot as a
    loop over its batch, and per-(block, KV head) products cost more in loop overhead than they
    save (docs/performance.md, "Attention"). Under tensor parallelism (K split over devices by
    sharding annotations) merging would make XLA all-gather the cache: False keeps K a batch axis.
    """
    t, h, dh = q.shape
    _, _, bs, kh, _ = cache.k.shape
    g = h // kh
    tile = pair_tile(meta.context_lens.shape[0])
    qpos = meta.positions[0]  # [T]
    own = (jnp.arange(h, dtype=jnp.int32) // g)[:, None] == \
        (jnp.arange(bs * kh, dtype=jnp.int32) % kh)[None]  # [H, BS*K]: merged layout's mask

    dtype = _compute_dtype(q, cache)

    def body(i, carry):
        blocks, toks, starts = lax.dynamic_slice_in_dim(meta.pairs, i * tile, tile, axis=1)
        # [P, BS, K, Dh] each; int8: scales [P, BS, K]
        keys, values, kscale, vscale = _pages(cache, layer, blocks, dtype)
        qp = q[toks].astype(dtype)  # [P, H, Dh]
        if merge_kv_heads:
            keys = keys.reshape(tile, bs * kh, dh)  # [P, S = BS*K, Dh], s = slot*K + k
            values = values.reshape(tile, bs * kh, dh)
            dots = jnp.einsum("PHD,PSD->PHS", qp, keys, preferred_element_type=jnp.float32)
            if kscale is not None:  # [P, 1, S]
                kscale, vscale = (x.reshape(tile, 1, bs * kh) for x in (kscale, vscale))
                dots = dots * kscale
            scores = logits.scaled(dots, dh)
            kpos = starts[:, None] + jnp.arange(bs * kh, dtype=jnp.int32)[None] // kh
            visible = logits.visible(kpos, qpos[toks][:, None])[:, None] & own[None]  # [P, H, S]
            return _online_update(carry, scores, visible, values, toks, t, "PHS,PSD->PHD",
                                  vscale)
        m, l, acc = carry
        qg = qp.reshape(tile, kh, g, dh)  # [P, K, G, Dh]
        dots = jnp.einsum("PKGD,PSKD->PKGS", qg, keys, preferred_element_type=jnp.float32)
        if kscale is not None:  # [P, K, 1, BS]
            kscale, vscale = (x.transpose(0, 2, 1)[:, :, None] for x in (kscale, vscale))
            dots = dots * kscale
        scores = logits.scaled(dots, dh)
        kpos = starts[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]  # [P, BS]
        visible = logits.visible(kpos, qpos[toks][:, None])[:, None, None]  # [P, 1, 1, BS]
        carry = (m.reshape(t, kh, g), l.reshape(t, kh, g), acc.reshape(t, kh, g, dh))
        m, l, acc = _online_update(carry, scores, visible, values, toks, t, "PKGS,PSKD->PKGD",
                                   vscale)
        return m.reshape(t, h), l.reshape(t, h), acc.reshape(t, h, dh)

    init = (jnp.full((t, h), MASK_VALUE, jnp.float32), jnp.zeros((t, h), jnp.float32),
            jnp.zeros((t, h, dh), jnp.float32))
    n_tiles = (meta.num_pairs + tile - 1) // tile
    _, l, acc = lax.fori_loop(0, n_tiles, body, init)
    # Tokens with no pairs (multi-query, idle) keep 0 rather than 0 / 0.
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _chunked_attention(q, cache: KVCache, layer, meta: PagedMeta, logits: _Logits):
    """Attention of multi-query rows in aligned chunks of QUERY_CHUNK queries: `[T, H, Dh]`.

    Chunk c holds flat tokens [c * QUERY_CHUNK, (c + 1) * QUERY_CHUNK), all of one row (or
    idle); it reads its row's pages `meta.chunk_pages[c]` one key tile at a time, causally
    masked by position. The loop runs as many tiles as the furthest multi-query token needs.
    """
    t, h, dh = q.shape
    _, _, bs, kh, _ = cache.k.shape
    g, qc, c = h // kh, QUERY_CHUNK, t // QUERY_CHUNK
    kt = kv_tile_blocks(bs)
    width = kt * bs
    qpos = meta.positions[0, :c * qc].reshape(c, qc)  # [C, Q]
    dtype = _compute_dtype(q, cache)
    qg = q[:c * qc].reshape(c, qc, kh, g, dh).astype(dtype)  # [C, Q, K, G, Dh]
    far = jnp.where(meta.multi[:c * qc], meta.positions[0, :c * qc], -1).max()
    n_tiles = jnp.where(far >= 0, far // width + 1, 0)

    def body(j, carry):
        m, l, acc = carry  # [C, K, G, Q], same, [C, K, G, Q, Dh]
        blocks = lax.dynamic_slice_in_dim(meta.chunk_pages, j * kt, kt, axis=1)  # [C, kt]
        keys, values, kscale, vscale = _pages(cache, layer, blocks, dtype)
        keys = keys.reshape(c, width, kh, dh)  # [C, S, K, Dh]
        values = values.reshape(c, width, kh, dh)
        dots = jnp.einsum("CQKGD,CSKD->CKGQS", qg, keys, preferred_element_type=jnp.float32)
        if kscale is not None:  # int8: scales [C, K, 1, 1, S]
            kscale, vscale = (x.reshape(c, width, kh).transpose(0, 2, 1)[:, :, None, None]
                              for x in (kscale, vscale))
            dots = dots * kscale
        scores = logits.scaled(dots, dh)
        kpos = j * width + jnp.arange(width, dtype=jnp.int32)  # [S]
        visible = logits.visible(kpos[None, None], qpos[:, :, None])[:, None, None]  # [C,1,1,Q,S]
        scores = jnp.where(visible, scores, MASK_VALUE)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        # int8: value scales weight p (where: an unseen slot's scale may be NaN).
        pw = p if vscale is None else jnp.where(visible, p * vscale, 0.0)
        pv = jnp.einsum("CKGQS,CSKD->CKGQD", pw.astype(values.dtype), values,
                        preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((c, kh, g, qc), MASK_VALUE, jnp.float32),
            jnp.zeros((c, kh, g, qc), jnp.float32), jnp.zeros((c, kh, g, qc, dh), jnp.float32))
    _, l, acc = lax.fori_loop(0, n_tiles, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [C, K, G, Q, Dh]
    out = out.transpose(0, 3, 1, 2, 4).reshape(c * qc, h, dh)
    return jnp.pad(out, ((0, t - c * qc), (0, 0), (0, 0)))
