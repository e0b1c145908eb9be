"""Rotary position embedding in HF's rotate-half layout, with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies, float32 `[head_dim // 2]`, as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (np.float32(config.rope_theta) **
                      (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    s = config.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, and the band in
    # between interpolated smoothly, so short-range attention is unchanged.
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotates `x` `[B, T, N, Dh]` by `positions` `[B, T]` (rotate-half pairing i, i + Dh/2)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
    # cos/sin are computed in float32 and cast to the activation dtype, as transformers does.
    cos = jnp.cos(freqs).astype(x.dtype)[:, :, None, :]  # [B, T, 1, Dh/2]
    sin = jnp.sin(freqs).astype(x.dtype)[:, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
