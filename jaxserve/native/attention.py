"""The native CPU ragged paged attention (cpu_attention.cc) as a JAX op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native


def ragged_paged_attention_cpu(q, k_cache, v_cache, layer, page_table, query_start,
                               context_lens):
    """q `[T, H, Dh]` (f32/bf16), caches `[L, N, BS, K, Dh]` (f32/bf16, read in place), layer
    [] int32, page_table `[R, M]`, query_start `[R + 1]`, context_lens `[R]` -> `[T, H, Dh]`
    float32; tokens of no row get zeros. Semantics: PagedMeta's page-table layout."""
    native.load()
    t, h, dh = q.shape
    call = jax.ffi.ffi_call("jaxserve_ragged_paged_attention",
                            jax.ShapeDtypeStruct((t, h, dh), jnp.float32))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), query_start, context_lens,
                page_table, scale=np.float32(1.0 / np.sqrt(dh)))
