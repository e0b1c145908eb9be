"""Paged KV cache: layout, memory planning, and the per-step metadata attention reads."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxserve.runtime import kv_quant
from models.config import ModelConfig

log = logging.getLogger("jaxserve")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K and V for all layers, `[L, num_blocks, block_size, K, Dh]` each.

    Block-major layout: one block of one layer is a contiguous `[block_size, K, Dh]` tile, so the
    XLA path gathers whole pages through the page table with a single gather and reshapes
    `[B, n_blocks, block_size, K, Dh]` into a contiguous context without a transpose.
    Block 0 is the null block: padding entries of the page table point at it and padded tokens
    write into it; it is never read unmasked.

    int8 cache (kv_quant.py): k/v hold int8 codes and k_scale/v_scale `[L, num_blocks,
    block_size, K]` float32 the scale of each (token, KV head); None for float caches. Every
    leaf has the block axis second, so block copies and the head split treat them alike.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def new_cache(shape: tuple[int, ...], dtype) -> KVCache:
    """Zeros `shape` `[L, NB, BS, K, Dh]` of dtype; int8 adds zero scales `[L, NB, BS, K]`."""
    if kv_quant.is_quantized(dtype):
        return KVCache(k=jnp.zeros(shape, jnp.int8), v=jnp.zeros(shape, jnp.int8),
                       k_scale=jnp.zeros(shape[:-1], kv_quant.SCALE_DTYPE),
                       v_scale=jnp.zeros(shape[:-1], kv_quant.SCALE_DTYPE))
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedMeta:
    """What paged attention needs besides q/k/v for one ragged step (step_layout.py).

    T flat tokens, R rows (scheduled sequences); row r's queries are the flat tokens
    [query_start[r], query_start[r + 1]) at positions context_lens[r] - q_len + i.
    """

    positions: jax.Array     # [1, T] int32: absolute position of each query token
    slots: jax.Array         # [1, T] int32: flat cache slot (block * block_size + offset) to write
    query_start: jax.Array   # [R + 1] int32
    context_lens: jax.Array  # [R] int32: keys of each row after this step's writes
    # [R, max_blocks] int32: block ids of each row's context, 0-padded ("page_table" backends);
    # [R, 1] zeros for the XLA path, which reads the two lists below instead.
    page_table: jax.Array
    # XLA path. pairs [3, W] int32: (block id, flat token, first position of the block) for every
    # block a single-query row's query sees, padded with (0, 0, huge); num_pairs [] int32 in use.
    pairs: jax.Array | None = None
    num_pairs: jax.Array | None = None
    # multi [T] bool: token in a multi-query row (aligned to QUERY_CHUNK, gaps included);
    # chunk_pages [T / QUERY_CHUNK, Pc] int32: the blocks of each chunk's row.
    multi: jax.Array | None = None
    chunk_pages: jax.Array | None = None


def bytes_per_token(config: ModelConfig, dtype) -> int:
    """KV bytes of one token in a cache of dtype, scales included (int8)."""
    return config.kv_bytes_per_token(*kv_quant.bytes_per_element(dtype))


def plan_num_blocks(config: ModelConfig, block_size: int, dtype, memory_bytes: int) -> int:
    """Blocks (including the null block) of a dtype cache that fit in `memory_bytes`."""
    per_block = block_size * bytes_per_token(config, dtype)
    return int(memory_bytes // per_block)


def log_plan(config: ModelConfig, block_size: int, dtype, num_blocks: int) -> None:
    dtype_bytes, scale_bytes = kv_quant.bytes_per_element(dtype)
    per_token = bytes_per_token(config, dtype)
    textbook = 2 * config.num_layers * config.hidden_size * dtype_bytes
    log.info("KV cache: %d bytes/token (2*layers*kv_heads*(head_dim*bytes + scale bytes) = "
             "2*%d*%d*(%d*%d + %d); the 2*L*d_model*p formula would say %d), %d blocks of %d "
             "tokens = %d tokens, %.1f MiB", per_token, config.num_layers, config.num_kv_heads,
             config.head_dim, dtype_bytes, scale_bytes, textbook, num_blocks - 1, block_size,
             (num_blocks - 1) * block_size, num_blocks * block_size * per_token / 2**20)
