"""Gemma's RMSNorm: normalised in float32, scaled by (1 + w) before the cast back.

transformers' Gemma2RMSNorm / Gemma3RMSNorm compute `(x * (1 + w)).to(dtype)` where Llama's
computes `x.to(dtype) * w`; the stored weight is w (zero-centred), as in the checkpoint.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class GemmaRMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
