"""int8 KV cache: symmetric per (token, KV head) quantization of K and V.

Each `[Dh]` vector of one token and KV head is stored as int8 codes `round(x * (1 / s))` in
[-127, 127] with its scale `s = max|x| * float32(1 / 127)` (an all-zero vector gets s = 0 and
codes 0).
Scales live beside the codes with the same leading axes, `[L, NB, BS, K]`, so everything that
moves or shares blocks (copy-on-write, prefix caching, tensor parallel's split over K) moves
the scales with them.

Scales are float32 whatever the activation dtype: a bf16 scale would round every vector's scale
by up to 2^-9 relative, comparable to the codes' own step (1/254 of the vector's range), for
2 bytes per (token, head) saved (3% of a 64-dim head's codes); float32 also keeps one kernel
signature for f32 and bf16 models and makes dequantization exact against a float64 oracle.
"""

from __future__ import annotations

import jax.numpy as jnp

SCALE_DTYPE = jnp.float32
SCALE_BYTES = 4      # per (token, KV head) for K and again for V
QMAX = 127.0


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.int8


def quantize(x):
    """x `[..., Dh]` float -> (codes `[..., Dh]` int8, scale `[...]` float32)."""
    xf = x.astype(jnp.float32)
    # A product with the rounded reciprocal, not a division: XLA rewrites x / c so, and this
    # keeps the rule one that any implementation reproduces bit for bit.
    scale = jnp.max(jnp.abs(xf), axis=-1) * jnp.float32(1.0 / QMAX)  # [...]
    # A zero vector has scale 0: its reciprocal is taken as 1 (its codes are 0 either way).
    # x times the rounded reciprocal, as XLA would rewrite x / broadcast(scale): written out,
    # so any implementation reproduces the codes bit for bit.
    inv = 1.0 / jnp.where(scale > 0, scale, 1.0)  # [...]
    codes = jnp.round(xf * inv[..., None])
    return jnp.clip(codes, -QMAX, QMAX).astype(jnp.int8), scale.astype(SCALE_DTYPE)


def dequantize(codes, scale, dtype=jnp.float32):
    """codes `[..., Dh]` int8, scale `[...]` -> `[..., Dh]` in dtype (product in float32)."""
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def bytes_per_element(dtype) -> tuple[int, int]:
    """(bytes per K or V element, scale bytes per (token, KV head) for K or V) of a cache
    dtype: (1, 4) for int8, (itemsize, 0) for float caches."""
    dt = jnp.dtype(dtype)
    return (1, SCALE_BYTES) if is_quantized(dt) else (dt.itemsize, 0)
