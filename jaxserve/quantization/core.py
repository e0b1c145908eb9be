"""Affine and symmetric integer quantization of a linear kernel, and the one weight pytree.

A linear kernel is w [K, N] (in, out). Parameters are shared along K: per tensor (one scale),
per output channel (one per column: group = K) or per group of `g` rows (g in 32/64/128).

Affine (asymmetric), b bits:  s = (r_max - r_min) / (2^b - 1),  z = round(-r_min / s),
    q = clip(round(r / s) + z, 0, 2^b - 1),  r_hat = s (q - z)
Symmetric:                     s = r_max / (2^(b-1) - 1) with r_max = max|r|,  z = 0,
    q = clip(round(r / s), -(2^(b-1) - 1), 2^(b-1) - 1),  r_hat = s q

Every inference path consumes one registered pytree per kernel (models/quantized.py, where
models/llama.py and models/checkpoint.py can see it too):
    Int4Weight(packed uint8 [K/2, N], scales [K/g, N], offsets [K/g, N] or None: -8 s)
    Int8Weight(q8 int8 [N, K], scales [K/g, N], offsets [K/g, N] or None: 0)
    w[k, n] = scales[k // g, n] * code[k, n] + offsets[k // g, n], g a static field
where the int4 code is the unsigned nibble u in [0, 15] (pallas_kernels.int4_matmul's packed
layout) and the int8 code is the signed byte, stored output-major (q8[n, k] = code[k, n]): the
layout of GGUF's Q8_0 rows, and the one XLA's CPU int8 dot runs fastest (2-3x at small batch;
see quantization/linear.py). g = K // scales.shape[0]; per tensor is stored as per channel with
equal columns, so every consumer sees the same shapes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.quantized import Int4Weight, Int8Weight, QuantizedWeight
from pallas_kernels.int4_matmul import pack_int4, unpack_int4

GRANULARITIES = ("tensor", "channel", "group")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How to quantize one kernel. `group_size` is used only with granularity 'group'."""

    bits: int = 4
    granularity: str = "group"
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got "
                             f"{self.granularity!r}")
        if self.granularity == "group" and self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size!r}")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1) - 1) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2 ** self.bits - 1

    def rows_per_group(self, k: int) -> int:
        if self.granularity != "group":
            return k
        if k % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide the input dimension "
                             f"{k}; pick one of 32/64/128 that does")
        return self.group_size


def _grouped(w, g):
    k, n = w.shape
    return w.astype(jnp.float32).reshape(k // g, g, n)  # [K/g, g, N]


def compute_qparams(w, spec: QuantSpec):
    """Scale and zero point of w [K, N] -> (s [K/g, N], z [K/g, N]) as float32.

    A constant group (s would be 0) gets s = 1, so it still dequantizes exactly when z covers it.
    """
    g = spec.rows_per_group(w.shape[0])
    wg = _grouped(w, g)
    axes = (1,) if spec.granularity != "tensor" else (1, 2)
    if spec.symmetric:
        r_max = jnp.max(jnp.abs(wg), axis=axes, keepdims=True)
        s = r_max / spec.qmax
        s = jnp.where(s == 0, 1.0, s)
        z = jnp.zeros_like(s)
    else:
        r_min = jnp.min(wg, axis=axes, keepdims=True)
        r_max = jnp.max(wg, axis=axes, keepdims=True)
        s = (r_max - r_min) / (2 ** spec.bits - 1)
        s = jnp.where(s == 0, 1.0, s)
        z = jnp.round(-r_min / s)
    shape = (wg.shape[0], wg.shape[2])
    return jnp.broadcast_to(s[:, 0], shape), jnp.broadcast_to(z[:, 0], shape)


def quantize_with(w, s, z, spec: QuantSpec):
    """Codes q [K, N] (int32) of w [K, N] for given s, z [K/g, N]."""
    k, n = w.shape
    g = k // s.shape[0]
    q = jnp.round(_grouped(w, g) / s[:, None]) + z[:, None]
    return jnp.clip(q, spec.qmin, spec.qmax).astype(jnp.int32).reshape(k, n)


def dequantize_codes(q, s, z):
    """r_hat = s (q - z), [K, N] float32."""
    k, n = q.shape
    g = k // s.shape[0]
    return (s[:, None] * (q.reshape(k // g, g, n) - z[:, None])).reshape(k, n)


def quantize(w, spec: QuantSpec):
    """Round-to-nearest: (q [K, N] int32, s [K/g, N], z [K/g, N])."""
    s, z = compute_qparams(w, spec)
    return quantize_with(w, s, z, spec), s, z


def to_weight(q, s, z, spec: QuantSpec) -> QuantizedWeight:
    """Codes and parameters -> the inference pytree (see the module docstring)."""
    k, _ = q.shape
    g = k // s.shape[0]
    if spec.bits == 4:
        if spec.granularity != "group":
            raise ValueError("int4 inference weights are per group (the kernel's layout); "
                             "use granularity='group'")
        if spec.symmetric:  # q in [-7, 7] -> u = q + 8, offsets -8 s (the implicit default)
            return Int4Weight(packed=pack_int4(q + 8, group_size=g), scales=s, group_size=g)
        return Int4Weight(packed=pack_int4(q, group_size=g), scales=s, offsets=-s * z,
                          group_size=g)
    if spec.symmetric:
        return Int8Weight(q8=q.T.astype(jnp.int8), scales=s, group_size=g)
    # Unsigned codes [0, 255] stored as signed bytes c = q - 128: s (q - z) = s c + s (128 - z).
    return Int8Weight(q8=(q - 128).T.astype(jnp.int8), scales=s, offsets=s * (128.0 - z),
                      group_size=g)


def dequantize_weight(w: QuantizedWeight):
    """The float32 kernel [K, N] that a quantized weight stands for."""
    s = w.scales.astype(jnp.float32)
    if isinstance(w, Int4Weight):
        code = unpack_int4(w.packed, group_size=w.group_size).astype(jnp.float32)
        default = -8.0 * s
    elif isinstance(w, Int8Weight):
        code = w.q8.T.astype(jnp.float32)
        default = jnp.zeros_like(s)
    else:
        raise TypeError(f"not a quantized weight: {type(w).__name__}")
    b = default if w.offsets is None else w.offsets.astype(jnp.float32)
    k, n = code.shape
    g = w.group_size
    return (s[:, None] * code.reshape(k // g, g, n) + b[:, None]).reshape(k, n)
