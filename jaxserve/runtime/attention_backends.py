"""Attention backends as objects: what each consumes and supports, and its two entry points.

The runner builds every step's metadata from a backend's declarations, never from which function
it is: `decode_layout` says whether its decode reads the flat list of blocks in use
(`PagedMeta.ragged`) or the page table cut to a block bucket; `per_shard` says whether, under
tensor parallelism, it must run on each device's heads (shard_map) or can take sharding
annotations; `supports` says which model shapes it cannot run. The model receives one entry point
per step kind, `(q, k, v, cache, layer, meta) -> (out, cache)`: a step of one token per row is
a decode, any other a prefill chunk.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, Literal

from jaxserve.runtime.attention import paged_attention_xla, write_kv
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from models.config import ModelConfig
from pallas_kernels.paged_attention import paged_attention

DecodeLayout = Literal["ragged", "page_table"]
AttentionFn = Callable[..., tuple]  # (q, k, v, cache, layer, meta) -> (out, cache)

# What the Triton paged-attention kernel is built for (power-of-2 tiles, see its module).
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


class AttentionBackend(abc.ABC):
    """One attention implementation on the paged KV cache, and what it declares about itself."""

    decode_layout: ClassVar[DecodeLayout]
    # A pallas_call is opaque to the SPMD partitioner: a kernel must run on each device's heads.
    per_shard: ClassVar[bool]

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The `attention_backend` config string that selects this backend."""

    @abc.abstractmethod
    def decode(self, q, k, v, cache: KVCache, layer, meta: PagedMeta):
        """q `[B, 1, H, Dh]`, k/v `[B, 1, K, Dh]`: writes k/v, returns (`[B, 1, H, Dh]`, cache)."""

    @abc.abstractmethod
    def prefill(self, q, k, v, cache: KVCache, layer, meta: PagedMeta):
        """q `[1, T, H, Dh]`, k/v `[1, T, K, Dh]`: writes k/v, returns (`[1, T, H, Dh]`, cache)."""

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        """Why this backend cannot run `config` with `block_size`; empty when it can."""
        return ()

    def for_tensor_parallel(self) -> AttentionBackend:
        """This backend as configured to run with its KV heads split over devices."""
        return self


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaAttention(AttentionBackend):
    """Pure jax.numpy (attention.py): runs everywhere; the CPU path and the oracle.

    Decode reads the flat list of blocks in use, so no row pays for the longest context.
    """

    # False keeps K a batch axis of the decode dots: with K split over devices by sharding
    # annotations, merging it into the token axis would make XLA all-gather the cache.
    merge_kv_heads: bool = True
    decode_layout: ClassVar[DecodeLayout] = "ragged"
    per_shard: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return "xla"

    def decode(self, q, k, v, cache, layer, meta):
        return paged_attention_xla(q, k, v, cache, layer, meta, self.merge_kv_heads)

    def prefill(self, q, k, v, cache, layer, meta):
        return paged_attention_xla(q, k, v, cache, layer, meta, self.merge_kv_heads)

    def for_tensor_parallel(self) -> XlaAttention:
        return dataclasses.replace(self, merge_kv_heads=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasAttention(AttentionBackend):
    """The Pallas paged-attention kernel for decode, XLA for prefill chunks.

    A prefill chunk is a dense `[T, S]` problem over gathered pages that XLA's fused dot handles
    well; the kernel is for the bandwidth-bound decode step, and reads the page table.
    """

    interpret: bool = False  # the Pallas interpreter: the kernel on CPU, for tests
    decode_layout: ClassVar[DecodeLayout] = "page_table"
    per_shard: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "pallas-interpret" if self.interpret else "pallas"

    def decode(self, q, k, v, cache, layer, meta):
        cache = write_kv(cache, layer, k, v, meta.slots)
        # The kernel takes q in the cache's dtype (kv_cache_dtype may differ from the model's).
        out = paged_attention(q[:, 0].astype(cache.k.dtype), cache.k, cache.v, layer,
                              meta.page_table, meta.context_lens,
                              interpret=self.interpret)  # [B, H, Dh]
        return out[:, None].astype(q.dtype), cache

    def prefill(self, q, k, v, cache, layer, meta):
        return paged_attention_xla(q, k, v, cache, layer, meta)

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        reasons = []
        if config.head_dim not in KERNEL_HEAD_DIMS:
            reasons.append(f"head_dim {config.head_dim} (kernel: {KERNEL_HEAD_DIMS})")
        if block_size not in KERNEL_BLOCK_SIZES:
            reasons.append(f"block_size {block_size} (kernel: {KERNEL_BLOCK_SIZES})")
        return tuple(reasons)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrappedAttention(AttentionBackend):
    """`inner`'s declarations with wrapped entry points (e.g. per shard under tensor parallel)."""

    inner: AttentionBackend
    decode_fn: AttentionFn
    prefill_fn: AttentionFn

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def decode_layout(self) -> DecodeLayout:  # type: ignore[override]
        return self.inner.decode_layout

    @property
    def per_shard(self) -> bool:  # type: ignore[override]
        return self.inner.per_shard

    def decode(self, q, k, v, cache, layer, meta):
        return self.decode_fn(q, k, v, cache, layer, meta)

    def prefill(self, q, k, v, cache, layer, meta):
        return self.prefill_fn(q, k, v, cache, layer, meta)

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        return self.inner.supports(config, block_size)

    def for_tensor_parallel(self) -> AttentionBackend:
        return self
