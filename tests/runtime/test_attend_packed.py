"""The attention backends' packed entry (AttentionBackend.attend_packed: q, k and v side by
side, as the fused q/k/v kernel makes them). On the Mosaic GPU attention (interpreted) the
step's keys and values are written by the Triton KV-write kernel straight from the packed
array, where `attend` writes them with XLA's scatters: the same caches, bit for bit, and the
same output, which is the reference attention's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.attention_backends import PallasAttention
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from pallas_kernels.cases import ATTENTION_TOLERANCE
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

H, K, DH, BS, NB, L = 4, 2, 64, 16, 8, 2


def _step(seed):
    """A decode row (context 20, its pages 3 and 5) and a 3-token chunk of a new row (page 6),
    a padding token, in layer 1 of a bf16 cache holding earlier keys and values."""
    rng = np.random.default_rng(seed)
    cache = KVCache(*(jnp.asarray(rng.normal(size=(L, NB, BS, K, DH)), jnp.bfloat16)
                      for _ in range(2)))
    qkv = jnp.asarray(rng.normal(size=(1, 5, H + 2 * K, DH)), jnp.bfloat16)  # [1, T, H+2K, Dh]
    positions = np.asarray([19, 0, 1, 2, 0], np.int32)
    slots = np.asarray([5 * BS + 3, 6 * BS, 6 * BS + 1, 6 * BS + 2, 0], np.int32)  # pad: null
    meta = PagedMeta(positions=jnp.asarray(positions)[None], slots=jnp.asarray(slots)[None],
                     query_start=jnp.asarray([0, 1, 4], jnp.int32),
                     context_lens=jnp.asarray([20, 3], jnp.int32),
                     page_table=jnp.asarray([[3, 5], [6, 0]], jnp.int32))
    return qkv, cache, meta


def test_mosaic_packed_entry_writes_with_one_kernel_as_attend_does():
    qkv, cache, meta = _step(0)
    backend = PallasAttention(kernels="mosaic", interpret=True)
    got, got_cache = backend.attend_packed(qkv, cache, 1, meta, num_heads=H)
    q, k, v = jnp.split(qkv, (H, H + K), axis=2)
    want, want_cache = backend.attend(q, k, v, cache, 1, meta)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # Not vacuous: the step's keys landed (row 0's at its slot, the chunk's in page 6).
    np.testing.assert_array_equal(np.asarray(got_cache.k[1, 5, 3], np.float32),
                                  np.asarray(k[0, 0], np.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    ref = ragged_paged_attention_reference(q[0], got_cache.k, got_cache.v, 1, meta.page_table,
                                           meta.query_start, meta.context_lens)  # [T, H, Dh]
    np.testing.assert_allclose(np.asarray(got[0, :4], np.float32),
                               np.asarray(ref[:4], np.float32), **ATTENTION_TOLERANCE["bfloat16"])
