"""The native CPU ragged paged attention (cpu_attention.cc) as a JAX op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native


def ragged_paged_attention_cpu(q, k_cache, v_cache, layer, page_table, query_start,
                               context_lens, *, k_scale=None, v_scale=None):
    """q `[T, H, Dh]` (f32/bf16), caches `[L, N, BS, K, Dh]` (f32/bf16, read in place), layer
    [] int32, page_table `[R, M]`, query_start `[R + 1]`, context_lens `[R]` -> `[T, H, Dh]`
    float32; tokens of no row get zeros. Semantics: PagedMeta's page-table layout.
    An int8 cache (kv_quant.py) passes its codes as k/v_cache and k_scale/v_scale
    `[L, N, BS, K]` float32."""
    native.load()
    t, h, dh = q.shape
    out = jax.ShapeDtypeStruct((t, h, dh), jnp.float32)
    layer = jnp.asarray(layer, jnp.int32)
    scale = np.float32(1.0 / np.sqrt(dh))
    if (k_scale is None) != (v_scale is None) or (k_scale is None) != (k_cache.dtype != jnp.int8):
        raise ValueError("an int8 cache comes with k_scale and v_scale, a float cache with none")
    if k_scale is None:
        call = jax.ffi.ffi_call("jaxserve_ragged_paged_attention", out)
        return call(q, k_cache, v_cache, layer, query_start, context_lens, page_table,
                    scale=scale)
    call = jax.ffi.ffi_call("jaxserve_ragged_paged_attention_int8", out)
    return call(q, k_cache, v_cache, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32),
                layer, query_start, context_lens, page_table, scale=scale)
