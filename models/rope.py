"""Rotary position embedding in HF's rotate-half layout, with the frequency scalings
transformers implements (`rope_type`): linear, dynamic NTK, YaRN, Llama 3 and LongRoPE.

Every scaling is computed as transformers' `ROPE_INIT_FUNCTIONS` computes it (float32
frequencies). Two of them depend on the length of the sequence in transformers: dynamic NTK
raises the base once a sequence passes `max_position_embeddings`, and LongRoPE switches from
`short_factor` to `long_factor` past `original_max_position_embeddings`. A KV cache holds keys
rotated when they were written, so the model uses the frequencies of a sequence of its
`max_position_embeddings` (models/config.py keeps that within the unswitched range), which
are transformers' for every sequence it serves.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling


def _base_frequencies(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
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
    return np.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling) -> np.ndarray:
    # YaRN: high frequencies (many rotations over the original context) extrapolate, low ones
    # interpolate by `factor`, with a linear ramp between the beta_fast / beta_slow dimensions.
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    orig = s.original_max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    return ((1.0 / (s.factor * pos_freqs)) * (1 - extrapolation)
            + (1.0 / pos_freqs) * extrapolation)


def inv_frequencies(config: ModelConfig, seq_len: int | None = None) -> np.ndarray:
    """Per-pair inverse frequencies, float32 `[head_dim // 2]`, as transformers computes them
    for a sequence of `seq_len` tokens (default: the config's max_position_embeddings)."""
    dim, theta, s = config.head_dim, config.rope_theta, config.rope_scaling
    seq_len = config.max_position_embeddings if seq_len is None else seq_len
    if s is None:
        out = _base_frequencies(theta, dim)
    elif s.rope_type == "linear":
        out = _base_frequencies(theta, dim) / np.float32(s.factor)
    elif s.rope_type == "dynamic":
        max_pos = config.max_position_embeddings
        length = max(seq_len, max_pos)
        base = theta * ((s.factor * length / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))
        out = _base_frequencies(base, dim)
    elif s.rope_type == "yarn":
        out = _yarn(theta, dim, s)
    elif s.rope_type == "llama3":
        out = _llama3(_base_frequencies(theta, dim), s)
    else:  # longrope
        long = seq_len > s.original_max_position_embeddings
        ext = np.asarray(s.long_factor if long else s.short_factor, np.float32)
        out = 1.0 / (ext * np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    return np.asarray(out, np.float32)


def attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN, LongRoPE; 1 otherwise)."""
    s = config.rope_scaling
    if s is None or s.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.rope_type == "longrope":
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
               scale: float = 1.0) -> jnp.ndarray:
    """Rotates `x` `[B, T, N, Dh]` by `positions` `[B, T]` (rotate-half pairing i, i + Dh/2);
    `scale` multiplies cos and sin (attention_factor)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
    # cos/sin are computed in float32 and cast to the activation dtype, as transformers does.
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos = cos.astype(x.dtype)[:, :, None, :]  # [B, T, 1, Dh/2]
    sin = sin.astype(x.dtype)[:, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
