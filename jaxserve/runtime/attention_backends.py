"""Attention backends as objects: what each consumes and supports, and its two entry points.

The runner builds every step's metadata from a backend's declarations, never from which function
it is: `layout` says whether it reads the XLA path's flat lists (`PagedMeta.pairs`,
`chunk_pages`: "ragged") or each row's page-table row ("page_table"); `per_shard` says whether,
under tensor parallelism, it must run on each device's heads (shard_map) or can take sharding
annotations; `supports` says which model shapes it cannot run. The model receives one entry
point, `attend(q, k, v, cache, layer, meta) -> (out, cache)`, for the whole ragged step: decode
tokens and prefill chunks of any number of sequences on one flat token axis (step_layout.py).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, Literal

import jax.numpy as jnp

from jaxserve import native
from jaxserve.native.attention import ragged_paged_attention_cpu
from jaxserve.runtime.attention import ragged_attention_xla, write_kv
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from models.config import ModelConfig
from pallas_kernels.kv_write import write_kv_cache, write_kv_cache_quantized
from pallas_kernels.mosaic_interpret import mosaic_interpret
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_write)
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu
from pallas_kernels.ragged_paged_attention_mgpu import unsupported as mosaic_attention_unsupported

Layout = Literal["ragged", "page_table"]
AttentionFn = Callable[..., tuple]  # (q, k, v, cache, layer, meta) -> (out, cache)

# What the Triton ragged paged-attention kernel is built for (power-of-2 tiles, see its module).
KERNEL_HEAD_DIMS = (64, 128)
# 256 compiles in bf16 only (f32 tiles overflow shared memory), and supports() sees no dtype.
KERNEL_BLOCK_SIZES = (8, 16, 32, 64, 128)


def windowed_features(config: ModelConfig) -> tuple[str, ...]:
    """The attention features of `config` beyond plain causal attention."""
    return tuple(name for name, on in (
        ("sliding window", config.sliding_window is not None),
        ("attention soft-capping", config.attn_logit_softcapping is not None),
        ("query_pre_attn_scalar", config.query_pre_attn_scalar is not None)) if on)


class AttentionBackend(abc.ABC):
    """One attention implementation on the paged KV cache, and what it declares about itself."""

    layout: ClassVar[Layout]
    # A pallas_call is opaque to the SPMD partitioner: a kernel must run on each device's heads.
    per_shard: ClassVar[bool]

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The `attention_backend` config string that selects this backend."""

    @abc.abstractmethod
    def attend(self, q, k, v, cache: KVCache, layer, meta: PagedMeta, *, window=None,
               softcap=None, scale=None):
        """q `[1, T, H, Dh]`, k/v `[1, T, K, Dh]` (T flat tokens): writes k/v, returns
        (`[1, T, H, Dh]`, cache). Tokens of no row (meta) may come back as anything finite.

        The layer's attention (models/llama.py `attention_kwargs`): window, an int32 scalar
        (traced: the layer's, from an array indexed by layer), so a query at p sees keys in
        (p - window, p]; softcap, a static float: logits `cap * tanh(s / cap)` before the
        mask; scale, a static float: the logit scale (default 1 / sqrt(Dh)). None: not used.
        """

    def attend_packed(self, qkv, cache: KVCache, layer, meta: PagedMeta, *, num_heads: int,
                      **kw):
        """attend() on q, k and v side by side, `[1, T, H + 2K, Dh]` (H = num_heads; q and k
        already rotated): what the fused-linear kernel makes (models/fused.py). Split here;
        a backend whose kernel reads them packed takes them as they are."""
        kv_heads = (qkv.shape[2] - num_heads) // 2
        q, k, v = jnp.split(qkv, (num_heads, num_heads + kv_heads), axis=2)
        return self.attend(q, k, v, cache, layer, meta, **kw)

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        """Why this backend cannot run `config` with `block_size`; empty when it can."""
        return ()

    def for_tensor_parallel(self) -> AttentionBackend:
        """This backend as configured to run with its KV heads split over devices."""
        return self


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaAttention(AttentionBackend):
    """Pure jax.numpy (attention.py): runs everywhere; the CPU path and the oracle.

    Single queries read the flat list of (query, block) pairs, so no row pays for the longest
    context; prefill chunks read their row's pages in aligned chunks (attention.py).
    """

    # False keeps K a batch axis of the decode dots: with K split over devices by sharding
    # annotations, merging it into the token axis would make XLA all-gather the cache.
    merge_kv_heads: bool = True
    layout: ClassVar[Layout] = "ragged"
    per_shard: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return "xla"

    def attend(self, q, k, v, cache, layer, meta, **kw):
        return ragged_attention_xla(q, k, v, cache, layer, meta, self.merge_kv_heads, **kw)

    def for_tensor_parallel(self) -> XlaAttention:
        return dataclasses.replace(self, merge_kv_heads=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuAttention(AttentionBackend):
    """The native CPU kernel (jaxserve/native/cpu_attention.cc) through the XLA FFI: the whole
    step, decodes and chunks, reading each row's pages in place. CPU only; the XLA path is its
    reference."""

    layout: ClassVar[Layout] = "page_table"
    # An FFI call is opaque to the SPMD partitioner, as a pallas_call is.
    per_shard: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "cpu"

    def attend(self, q, k, v, cache, layer, meta, **kw):
        if any(value is not None for value in kw.values()):
            raise ValueError(f"the native CPU kernel has no {sorted(kw)}: supports() refuses "
                             "such models, and attention_backend='auto' runs them on XLA")
        cache = write_kv(cache, layer, k, v, meta.slots)
        out = ragged_paged_attention_cpu(q[0], cache.k, cache.v, layer, meta.page_table,
                                         meta.query_start, meta.context_lens,
                                         k_scale=cache.k_scale,
                                         v_scale=cache.v_scale)  # [T, H, Dh]
        return out[None].astype(q.dtype), cache

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        reasons = []
        if config.head_dim % 16:
            reasons.append(f"head_dim {config.head_dim} (kernel: a multiple of 16)")
        reasons += [f"{name} (the native kernel has none)" for name in windowed_features(config)]
        why = native.unavailable_reason()
        if why:
            reasons.append(f"the native library: {why}")
        return tuple(reasons)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasAttention(AttentionBackend):
    """The Pallas ragged paged-attention kernel: the whole step, decodes and chunks, in one.

    It reads each row's page-table row, query span and context length. `kernels` picks its
    Pallas backend (EngineConfig.gpu_kernels, resolved): "triton"
    (pallas_kernels/ragged_paged_attention.py, the step's keys and values written by the
    kernel itself) or "mosaic" (pallas_kernels/ragged_paged_attention_mgpu.py, Hopper and
    later; the keys and values written first into the donated cache by the Triton KV-write
    kernel in one launch, from q, k and v packed where the fused q/k/v kernel made them).
    An int8 cache, on either backend: the KV-write kernel quantizes the step's keys and values
    and writes codes and scales in one launch, then the kernel reads them.
    """

    interpret: bool = False  # the Pallas interpreter: the kernel on CPU, for tests
    kernels: Literal["triton", "mosaic"] = "triton"
    # The cache's element type: what the Mosaic kernel is asked whether it can read (the
    # Triton kernel reads every float and int8 cache); the model's, q's with an int8 cache
    # (a float cache's q is cast to the cache's type).
    kv_dtype: str = "bfloat16"
    model_dtype: str = "bfloat16"
    layout: ClassVar[Layout] = "page_table"
    per_shard: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "pallas-interpret" if self.interpret else "pallas"

    def attend(self, q, k, v, cache, layer, meta, *, window=None, softcap=None, scale=None):
        if cache.quantized:
            cache = self._write_quantized(cache, layer, meta, (k[0], v[0]), None)
            return self._attend_int8(q[0], cache, layer, meta, window=window, softcap=softcap,
                                     scale=scale, dtype=q.dtype)
        if self.kernels == "mosaic":
            return self._attend_mosaic(q, k, v, cache, layer, meta, window=window,
                                       softcap=softcap, scale=scale)
        kw = self._kernel_kw(window, softcap, scale)
        # One array [T, H + 2K, Dh] in the cache's dtype (kv_cache_dtype may differ from the
        # model's): XLA makes q, k and v (RoPE, casts) in one fusion, and one kernel reads
        # them by row, writes k and v into the cache and attends.
        qkv = jnp.concatenate([q[0], k[0], v[0]], axis=1)
        out, cache = self._attend_triton(qkv, q.shape[2], cache, layer, meta, kw)
        return out[None].astype(q.dtype), cache

    def attend_packed(self, qkv, cache, layer, meta, *, num_heads, window=None, softcap=None,
                      scale=None):
        if cache.quantized:  # keys and values quantized from the packed array, q read in place
            kv_heads = (qkv.shape[2] - num_heads) // 2
            cache = self._write_quantized(cache, layer, meta, (qkv[0], qkv[0]),
                                          (num_heads, num_heads + kv_heads))
            return self._attend_int8(qkv[0], cache, layer, meta, window=window,
                                     softcap=softcap, scale=scale, dtype=qkv.dtype,
                                     num_heads=num_heads)
        if self.kernels == "mosaic":
            # One kernel writes the keys and values from the packed array (kv_write.py) where
            # XLA's write_kv takes three (the k/v split, a scatter per cache); the Mosaic
            # kernel then reads its first num_heads heads, the queries, in place.
            kv_heads = (qkv.shape[2] - num_heads) // 2
            packed = qkv[0].astype(cache.k.dtype)  # [T, H + 2K, Dh]
            kc, vc = write_kv_cache((cache.k, cache.v), layer, meta.slots[0], (packed, packed),
                                    heads_at=(num_heads, num_heads + kv_heads),
                                    interpret=self.interpret)
            return self._mosaic(packed, KVCache(k=kc, v=vc), layer, meta, window=window,
                                softcap=softcap, scale=scale, dtype=qkv.dtype,
                                num_heads=num_heads)
        out, cache = self._attend_triton(qkv[0], num_heads, cache, layer, meta,
                                         self._kernel_kw(window, softcap, scale))
        return out[None].astype(qkv.dtype), cache

    def _kernel_kw(self, window, softcap, scale) -> dict:
        """The layer's attention arguments as the Triton kernels take them."""
        return dict(window=window, softcap=softcap, sm_scale=scale, interpret=self.interpret)

    def _attend_triton(self, qkv, heads, cache, layer, meta, kw):
        """The Triton kernel on a float cache: qkv `[T, H + 2K, Dh]` (heads = H). Returns
        (`[T, H, Dh]`, cache)."""
        qkv = qkv.astype(cache.k.dtype)
        kv_heads = (qkv.shape[1] - heads) // 2
        args = (meta.page_table, meta.query_start, meta.context_lens)
        if cache.k.dtype == jnp.float32:
            # f32 (IEEE dots): the fused write's key loop spills in the tall prefill tile at
            # head_dim 128 (sm_90a ptxas), so the write is a kernel of its own.
            kc, vc = write_kv_cache((cache.k, cache.v), layer, meta.slots[0], (qkv, qkv),
                                    heads_at=(heads, heads + kv_heads),
                                    interpret=self.interpret)
            out = ragged_paged_attention(qkv, kc, vc, layer, *args, num_heads=heads, **kw)
        else:
            out, kc, vc = ragged_paged_attention_write(qkv, cache.k, cache.v, layer,
                                                       meta.slots[0], *args, num_heads=heads,
                                                       **kw)  # [T, H, Dh]
        return out, KVCache(k=kc, v=vc)

    def _write_quantized(self, cache, layer, meta, new, heads_at) -> KVCache:
        """The step's float keys and values (`[T, K, Dh]` each, or a packed array's heads at
        heads_at) quantized into the int8 cache, codes and scales, by one kernel in place."""
        leaves = write_kv_cache_quantized(
            (cache.k, cache.v, cache.k_scale, cache.v_scale), layer, meta.slots[0], new,
            heads_at=heads_at, interpret=self.interpret)
        return KVCache(*leaves)

    def _attend_int8(self, q, cache, layer, meta, *, window, softcap, scale, dtype,
                     num_heads=None):
        """Either kernel over an int8 cache holding the step's keys and values: q `[T, Hq, Dh]`
        in the model's dtype (its first num_heads heads). Returns (`[1, T, H, Dh]`, cache)."""
        if self.kernels == "mosaic":
            return self._mosaic(q, cache, layer, meta, window=window, softcap=softcap,
                                scale=scale, dtype=dtype, num_heads=num_heads)
        out = ragged_paged_attention(q, cache.k, cache.v, layer, meta.page_table,
                                     meta.query_start, meta.context_lens,
                                     k_scale=cache.k_scale, v_scale=cache.v_scale,
                                     num_heads=num_heads,
                                     **self._kernel_kw(window, softcap, scale))
        return out[None].astype(dtype), cache

    def _attend_mosaic(self, q, k, v, cache, layer, meta, *, window, softcap, scale):
        # The step's keys and values written into the donated float cache, in place, by one
        # kernel, where XLA's write_kv is a k/v split and a scatter per cache (predicted: the
        # int4 dense steps at batch 64 5-10% faster; OLMoE's 1% slower, XLA having fused its
        # scatters with what makes k and v); the Mosaic kernel then reads them with the rest
        # of the context, q in the cache's dtype as the Triton path reads it.
        dtype = cache.k.dtype
        kc, vc = write_kv_cache((cache.k, cache.v), layer, meta.slots[0],
                                (k[0].astype(dtype), v[0].astype(dtype)),
                                interpret=self.interpret)
        return self._mosaic(q[0].astype(dtype), KVCache(k=kc, v=vc), layer, meta,
                            window=window, softcap=softcap, scale=scale, dtype=q.dtype)

    def _mosaic(self, q, cache, layer, meta, *, window, softcap, scale, dtype,
                num_heads=None):
        """The Mosaic GPU kernel on q `[T, Hq, Dh]` (its first num_heads heads; None: all)
        over a cache holding the step's keys and values: (`[1, T, H, Dh]` in dtype, cache)."""
        out = ragged_paged_attention_mgpu(
            q, cache.k, cache.v, layer, meta.page_table,
            meta.query_start, meta.context_lens, k_scale=cache.k_scale, v_scale=cache.v_scale,
            window=window, softcap=softcap, num_heads=num_heads, sm_scale=scale,
            interpret=mosaic_interpret(self.interpret))  # [T, H, Dh]
        return out[None].astype(dtype), cache

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        if self.kernels == "mosaic":
            q_dtype = self.model_dtype if self.kv_dtype == "int8" else self.kv_dtype
            why = mosaic_attention_unsupported(config.num_heads, config.num_kv_heads,
                                               config.head_dim, block_size, q_dtype,
                                               kv_dtype=self.kv_dtype)
            return (f"the Mosaic GPU kernel: {why} (gpu_kernels='triton' runs the Triton "
                    "kernel)",) if why else ()
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
    attend_fn: AttentionFn

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def layout(self) -> Layout:  # type: ignore[override]
        return self.inner.layout

    @property
    def per_shard(self) -> bool:  # type: ignore[override]
        return self.inner.per_shard

    def attend(self, q, k, v, cache, layer, meta, **kw):
        return self.attend_fn(q, k, v, cache, layer, meta, **kw)

    def supports(self, config: ModelConfig, block_size: int) -> tuple[str, ...]:
        return self.inner.supports(config, block_size)

    def for_tensor_parallel(self) -> AttentionBackend:
        return self
