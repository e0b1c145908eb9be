"""Attention and linear backends: which implementation runs inside the jitted step.

`xla` is pure jax.numpy and runs everywhere (the CPU path and the oracle); `pallas` runs the
Pallas kernels (GPU); `pallas-interpret` runs the same kernels through the Pallas interpreter
on CPU, for tests. `auto` picks pallas on GPU and xla elsewhere.
"""

from __future__ import annotations

import logging

import jax
# Pallas imports its fuser lazily, the first time a kernel is lowered, and that import adds a
# value to JAX's tracing context: every program compiled before it would then be retraced once
# after warm-up. Importing it here keeps the context fixed from the start.
import jax.experimental.pallas.fuser  # noqa: F401

from jaxserve.runtime.attention import paged_attention_xla, write_kv
from jaxserve.config import BACKENDS
from jaxserve.quantization.linear import ACTIVATION_BITS, quantized_linear
from models.config import ModelConfig
from models.llama import Parallel, dense_linear
from models.quantized import Int8Weight, is_quantized
from pallas_kernels.paged_attention import paged_attention

log = logging.getLogger("jaxserve")

# What the Triton paged-attention kernel is built for (power-of-2 tiles, see its module).
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def resolve(kind: str) -> str:
    if kind not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {kind!r}")
    if kind == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return kind


def attention_backend(kind: str, config: ModelConfig, block_size: int, requested: str):
    """The attention function for the model; falls back to XLA where the kernel cannot run."""
    if kind == "xla":
        return paged_attention_xla
    unsupported = []
    if config.head_dim not in KERNEL_HEAD_DIMS:
        unsupported.append(f"head_dim {config.head_dim} (kernel: {KERNEL_HEAD_DIMS})")
    if block_size not in KERNEL_BLOCK_SIZES:
        unsupported.append(f"block_size {block_size} (kernel: {KERNEL_BLOCK_SIZES})")
    if unsupported:
        if requested != "auto":
            raise ValueError(f"attention_backend={requested!r} cannot run {', '.join(unsupported)}"
                             "; use attention_backend='xla'")
        log.info("paged-attention kernel unsupported for %s: using XLA attention", unsupported)
        return paged_attention_xla
    interpret = kind == "pallas-interpret"

    def attention(q, k, v, cache, layer, meta):
        if q.shape[1] != 1:
            # Prefill chunks attend over gathered pages in XLA: a dense [T, S] problem that
            # XLA's fused dot handles well; the kernel is for the bandwidth-bound decode step.
            return paged_attention_xla(q, k, v, cache, layer, meta)
        cache = write_kv(cache, layer, k, v, meta.slots)
        # The kernel takes q in the cache's dtype (kv_cache_dtype may differ from the model's).
        out = paged_attention(q[:, 0].astype(cache.k.dtype), cache.k, cache.v, layer,
                              meta.page_table, meta.context_lens,
                              interpret=interpret)  # [B, H, Dh]
        return out[:, None].astype(q.dtype), cache

    return attention


def linear_backend(kind: str, activation_bits: int = 16):
    """`linear(x, w, parallel)`: x @ w, w a float kernel or a quantized one (models/quantized.py).

    Int4Weight runs the Pallas kernel (pallas*) or the XLA reference; Int8Weight runs integer
    dots in XLA, with int8 activations when `activation_bits` is 8 (W8A8). `parallel`, the
    layer's declared role, is for the tensor-parallel wrapper (TensorParallel.linear).
    """
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS}, got "
                         f"{activation_bits!r}")

    def linear(x, w, parallel: Parallel = None):
        if not is_quantized(w):
            return dense_linear(x, w, parallel)
        # W8A8 applies to int8 weights; int4 ones (none in a W8A8 model) keep float activations.
        bits = activation_bits if isinstance(w, Int8Weight) else 16
        return quantized_linear(x, w, kind, bits)

    return linear
