"""The ragged paged-attention kernel's pure jax.numpy reference (pallas_kernels/
ragged_paged_attention.py): each token gathers its row's pages, at float32."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import check_scales, dequantize_cache


def _token_rows(query_start, num_tokens: int):
    """Each flat token's row `[T]` and whether it belongs to one `[T]` (tokens before
    query_start[0] and from query_start[R] on do not)."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    num_rows = query_start.shape[0] - 1
    # compare_all: one [T, R] fusion; the default (scan) is an XLA while loop, which on a GPU
    # reads its predicate back to the host every iteration.
    row = jnp.searchsorted(query_start[1:], tokens, side="right", method="compare_all")
    row = row.astype(jnp.int32)
    row = jnp.minimum(row, num_rows - 1)
    owned = (query_start[row] <= tokens) & (tokens < query_start[row + 1])
    return row, owned


def ragged_paged_attention_reference(q, k_cache, v_cache, layer, page_table, query_start,
                                     context_lens, *, k_scale=None, v_scale=None, window=None,
                                     softcap: float | None = None,
                                     sm_scale: float | None = None) -> jax.Array:
    """Each token gathers its row's pages, masks causally (and by the window), soft-caps,
    softmax in float32. Same shapes; tokens that belong to no row are zeros. An int8 cache
    (k_scale, v_scale given) is dequantized to float32 first."""
    if check_scales(q, k_cache, v_cache, k_scale, v_scale):
        k_cache, v_cache = dequantize_cache(k_cache, k_scale), dequantize_cache(v_cache, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    query_start = jnp.asarray(query_start, jnp.int32)
    context_lens = jnp.asarray(context_lens, jnp.int32)
    row, owned = _token_rows(query_start, num_tokens)  # [T], [T]
    q_len = query_start[row + 1] - query_start[row]
    pos = context_lens[row] - q_len + jnp.arange(num_tokens) - query_start[row]  # [T]
    keys = k_cache[layer][page_table[row]].astype(jnp.float32)  # [T, P, BS, K, Dh]
    values = v_cache[layer][page_table[row]].astype(jnp.float32)
    keys = keys.reshape(num_tokens, -1, num_kv_heads, head_dim)  # [T, S, K, Dh]
    values = values.reshape(num_tokens, -1, num_kv_heads, head_dim)
    key_pos = jnp.arange(keys.shape[1])[None, :]  # [1, S]
    visible = (key_pos <= pos[:, None]) & (key_pos < context_lens[row][:, None]) \
        & owned[:, None]  # [T, S]
    if window is not None:
        visible = visible & (key_pos > pos[:, None] - window)
    # Zero what is not visible, so NaN garbage there cannot leak through 0 * NaN.
    keys = jnp.where(visible[:, :, None, None], keys, 0.0)
    values = jnp.where(visible[:, :, None, None], values, 0.0)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None, :], probs, 0.0)  # tokens seeing nothing -> zeros
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values, precision=lax.Precision.HIGHEST)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
