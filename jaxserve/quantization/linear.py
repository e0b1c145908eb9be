"""Matmuls on the quantized weights (Int4Weight, Int8Weight: see core.py).

    y[m, n] = sum_k x[m, k] w[k, n],  w[k, n] = s[G(k), n] c[k, n] + b[G(k), n]
            = sum_G s[G, n] (x_G @ c_G)[m, n] + sum_G (sum_{k in G} x[m, k]) b[G, n]

int8 per channel (G = 1) runs the codes through integer dots, never a float copy of the weight:
XLA's CPU converts int8 -> f32 weights at ~0.3 G elements/s, slower than the matmul itself
(SmolLM2's LM head: ~95 ms per step, against 4-40 ms for the f32 product), while its int8 x int8
-> int32 dot on output-major codes ([N, K], contracting K on both sides) runs 2-7x faster than
f32 here (AMX). Measured figures: README, "Quantized inference".

- W8A8: activations quantized symmetric per token (row), x ~ sx[m] xq[m, k], sx = max|x[m]|/127:
      y = sx[m] s[n] (xq @ c)[m, n] + (sum_k x[m, k]) b[n]
- W8A16 (CPU): the float activations as two int8 limbs, u = x / sx = x1 + x2 / 254 + e with
  |e| <= 1/508, i.e. 16-bit fixed point per token (|x - x_hat| <= max|x[m]| / 64516), both
  limbs in one int8 dot. Elsewhere (GPU), and for per-group int8, the codes are converted to
  the activation dtype inside the step: exact, and fused there.
- int4 (W4A16 / W4A8) on CPU: the native kernel (jaxserve/native/cpu_quant_matmul.cc) on
  weights repacked at load (CpuPackedWeight); activations int8 per row (W4A8) or as the two
  W8A16 limbs (W4A16). Here, the XLA reference: the dequantized float weight, and for W4A8
      y = sx[m] (xq @ s (u - 8))[m, n] + (sum_{k in G} x[m, k]) (b + 8 s)[G, n]
  the kernel's split: only the symmetric part meets the quantized activations.
- A single row goes through XLA CPU's matrix-vector path, which is ~30x slower for int8 than
  its matrix-matrix one: rows are padded to at least 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.native.quant_matmul import quant_matmul_cpu
from models.quantized import CpuPackedWeight, Int4Weight, Int8Weight, QuantizedWeight
from pallas_kernels.int4_matmul import dequantize_int4, int4_matmul, int4_matmul_reference
from pallas_kernels.int4_matmul_mgpu import int4_matmul_mgpu
from pallas_kernels.int4_matmul_mgpu import unsupported as mosaic_int4_unsupported
from pallas_kernels.mosaic_interpret import mosaic_interpret

ACTIVATION_BITS = (16, 8)
LIMB = 254  # second-limb scale: the residual in [-0.5, 0.5] -> [-127, 127]


def _dot_nt(a, b, out_dtype):
    """a [M, K] @ b[N, K].T -> out_dtype [M, N]: both operands contract their last axis."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def quantize_activations(x):
    """Per-row symmetric int8: x [M, K] float -> (xq [M, K] int8, sx [M, 1] float32)."""
    x = x.astype(jnp.float32)
    sx = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0  # [M, 1]
    sx = jnp.where(sx == 0, 1.0, sx)
    return jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int8), sx


def activation_limbs(x):
    """x [M, K] -> (x1, x2 [M, K] int8, sx [M, 1]) with x ~ sx (x1 + x2 / 254)."""
    x1, sx = quantize_activations(x)
    r = x.astype(jnp.float32) / sx - x1.astype(jnp.float32)  # [M, K] in [-0.5, 0.5]
    return x1, jnp.clip(jnp.round(r * LIMB), -127, 127).astype(jnp.int8), sx


def _int8_dot_rows(xq, q8):
    """xq [M, K] int8 @ q8 [N, K].T -> [M, N] float32 (exact int32 sums), M padded to >= 2."""
    m = xq.shape[0]
    if m == 1:
        xq = jnp.pad(xq, ((0, 1), (0, 0)))
    return _dot_nt(xq, q8, jnp.int32)[:m].astype(jnp.float32)


def int8_linear(x, w: Int8Weight, activation_bits: int = 16, limbs: bool = True):
    """x [M, K] @ Int8Weight(q8 [N, K], scales [K/g, N], offsets?) -> [M, N] float32.

    `limbs`: W8A16 per channel via two int8 activation limbs (the fast CPU path, see above);
    False converts the codes to the activation dtype instead (exact float activations).
    Groups are read from the shapes, not `w.group_size`: under tensor parallelism a row shard
    of a per-channel weight sees K / N inputs with the whole kernel's one scale row.
    """
    q8, s = w.q8, w.scales.astype(jnp.float32)
    groups = s.shape[0]
    m, k = x.shape
    if activation_bits == 8:
        if groups != 1:
            raise ValueError("W8A8 needs per-channel int8 weights (scales [1, N]); got "
                             f"{groups} groups")
        xq, sx = quantize_activations(x)
        y = _int8_dot_rows(xq, q8) * sx * s  # [M, N]
    elif groups == 1 and limbs:
        x1, x2, sx = activation_limbs(x)
        y2 = _int8_dot_rows(jnp.concatenate([x1, x2]), q8)  # [2M, N]
        y = (y2[:m] + y2[m:] / LIMB) * sx * s
    elif groups == 1:
        y = _dot_nt(x, q8.astype(x.dtype), jnp.float32) * s  # [M, N]
    else:
        g = k // groups
        c = q8.reshape(-1, groups, g).astype(jnp.float32)  # [N, G, g]
        wt = (c * s.T[:, :, None]).reshape(-1, k)  # [N, K]: per-group scales need the float
        y = _dot_nt(x.astype(jnp.float32), wt, jnp.float32)
    if w.offsets is not None:
        xsum = x.astype(jnp.float32).reshape(m, groups, k // groups).sum(-1)  # [M, G]
        y = y + xsum @ w.offsets.astype(jnp.float32)
    return y


def int4_w4a8_reference(x, w: Int4Weight):
    """W4A8 in XLA (the native kernel's math, see above): x [M, K] -> [M, N] float32."""
    xq, sx = quantize_activations(x)
    m, k = x.shape
    scales = w.scales.astype(jnp.float32)
    w_sym = dequantize_int4(w.packed, scales, None, group_size=w.group_size)  # s (u - 8)
    y = jnp.dot(xq.astype(jnp.float32), w_sym, precision=jax.lax.Precision.HIGHEST) * sx
    if w.offsets is not None:
        xsum = x.astype(jnp.float32).reshape(m, -1, w.group_size).sum(-1)  # [M, G]
        y = y + jnp.dot(xsum, w.offsets.astype(jnp.float32) + 8.0 * scales,
                        precision=jax.lax.Precision.HIGHEST)
    return y


def int4_linear(x, w: Int4Weight, kind: str, activation_bits: int = 16,
                gpu_kernels: str = "triton"):
    """x [M, K] @ Int4Weight(packed [K/2, N], scales [K/g, N], offsets?) -> [M, N].

    The kernel and its reference take the plain arrays. W4A8 (`activation_bits` 8) runs its
    XLA reference on any backend (the Pallas kernel takes float activations). gpu_kernels
    "mosaic": the Mosaic GPU kernel where it takes the shape and dtype (static, at trace
    time), else the Triton one.
    """
    if activation_bits == 8:
        return int4_w4a8_reference(x, w)
    group = w.group_size
    args = (x, w.packed, w.scales, w.offsets)
    if kind == "xla":
        return int4_matmul_reference(*args, group_size=group)
    interpret = kind == "pallas-interpret"
    (m, k), n = x.shape, w.packed.shape[1]
    if gpu_kernels == "mosaic" and mosaic_int4_unsupported(m, k, n, group, x.dtype) is None:
        return int4_matmul_mgpu(*args, group_size=group, interpret=mosaic_interpret(interpret))
    return int4_matmul(*args, group_size=group, interpret=interpret)


def quantized_linear(x, w: QuantizedWeight, kind: str = "xla", activation_bits: int = 16,
                     limbs: bool | None = None, gpu_kernels: str = "triton"):
    """x [..., K] @ a quantized weight -> [..., N] float32, by the weight's type.

    `limbs` (int8 W8A16 only): None picks the limb path on CPU, the exact convert elsewhere.
    """
    if limbs is None:
        limbs = jax.default_backend() == "cpu"
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if isinstance(w, CpuPackedWeight):
        y = quant_matmul_cpu(x2, w, limbs=1 if activation_bits == 8 else 2)
    elif isinstance(w, Int4Weight):
        y = int4_linear(x2, w, kind, activation_bits, gpu_kernels)
    elif isinstance(w, Int8Weight):
        y = int8_linear(x2, w, activation_bits, limbs)
    else:
        raise TypeError(f"not a quantized weight: {type(w).__name__} (expected Int4Weight, "
                        "Int8Weight or CpuPackedWeight, models/quantized.py)")
    return y.reshape(*lead, y.shape[-1]).astype(jnp.float32)
