"""The native CPU quantized matmul (cpu_quant_matmul.cc) as a JAX op, and its numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native
from models.quantized import CpuPackedWeight

LIMB = 254  # as cpu_quant_matmul.cc's kLimb and quantization/linear.py's LIMB


def simd() -> bool:
    """Whether the loaded library runs a vector tile loop (AVX-512 VNNI or AVX2), else its
    portable one (slower than XLA's dots)."""
    return bool(native.load().jaxserve_quant_matmul_isa())


def quant_matmul_cpu(x, w: CpuPackedWeight, limbs: int, target: str = "jaxserve_quant_matmul"):
    """x [M, K] -> [M, N] float32 = x @ w, activations int8 per row (`limbs` 1: W4A8 / W8A8;
    2: the 16-bit two-limb fixed point of W8A16). w carries no leading axes, or is one layer
    of a stack (`w.layer` set: the kernel reads it in place). `target`: the FFI target (tests
    register other levels' builds under other names: native.load_build)."""
    native.load()
    m = x.shape[0]
    n16 = w.codes.shape[-3] * 16
    if (w.codes.ndim == 4) != (w.layer is not None):
        raise ValueError(f"codes {w.codes.shape} with layer {w.layer}: a stacked weight "
                         "[L, ...] needs its layer (CpuPackedWeight.at_layer), others none")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n16), jnp.float32))
    offsets = w.offsets if w.offsets is not None else jnp.zeros((0,), w.scales.dtype)
    y = call(x.astype(jnp.float32), w.codes, w.scales, offsets, bits=np.int32(w.bits),
             zero=np.int32(w.zero), shift=np.int32(w.shift), limbs=np.int32(limbs),
             layer=np.int32(w.layer or 0))  # [M, N16]
    return y if n16 == w.out_features else y[:, :w.out_features]


def quantize_rows_reference(x: np.ndarray, limbs: int):
    """numpy: x [M, K] float32 -> (limb codes [limbs, M, K] int8, sx [M] float32), the kernel's
    per-row quantization (x / sx rounded half to even; the residual times 254 the same)."""
    x = np.asarray(x, np.float32)
    sx = (np.max(np.abs(x), axis=-1) / np.float32(127)).astype(np.float32)
    sx = np.where(sx == 0, np.float32(1), sx)
    u = (x / sx[:, None]).astype(np.float32)
    q1 = np.clip(np.rint(u), -127, 127)
    out = [q1.astype(np.int8)]
    if limbs == 2:
        res = ((u - q1).astype(np.float32) * np.float32(LIMB)).astype(np.float32)
        out.append(np.clip(np.rint(res), -127, 127).astype(np.int8))
    return np.stack(out), sx


def quant_matmul_reference(x, u, scales, bias, zero: int, limbs: int) -> np.ndarray:
    """numpy, from the unpacked weight: x [M, K], codes u [K, N] (unsigned), scales / bias
    [G, N] (bias may be None): sx sum_G s (xq_G . u_G - z sum xq_G) + sum_G b sum x_G, with
    xq = x1 + x2 / 254; integer dots exact (int64), the rest in float64."""
    x = np.asarray(x, np.float32)
    q, sx = quantize_rows_reference(x, limbs)
    m, k = x.shape
    groups, n = scales.shape
    g = k // groups
    ug = np.asarray(u, np.int64).reshape(groups, g, n)
    y = np.zeros((m, n))
    for li in range(limbs):
        qg = q[li].astype(np.int64).reshape(m, groups, g)
        dot = np.einsum("mGk,Gkn->mGn", qg, ug) - zero * qg.sum(-1)[..., None]  # exact
        y += np.einsum("mGn,Gn->mn", dot / (LIMB ** li), np.asarray(scales, np.float64))
    y *= sx[:, None]
    if bias is not None:
        xs = x.astype(np.float64).reshape(m, groups, g).sum(-1)
        y += xs @ np.asarray(bias, np.float64)
    return y
