"""The native CPU float-weight matmul (cpu_float_matmul.cc) as a JAX op, and its numpy reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import native

WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)


def avx512() -> bool:
    """Whether the loaded library runs the AVX-512 loops (else its portable one)."""
    return bool(native.load().jaxserve_float_matmul_avx512())


def float_matmul_cpu(x, w, transposed: bool = False, target: str = "jaxserve_float_matmul"):
    """x [..., K] @ w -> [..., N] float32: w [K, N] (transposed False) or [N, K] (True: x @ w^T,
    the tied LM head), float32 or bfloat16, read as stored; x is taken in float32 (a bfloat16
    activation widens exactly). `target`: the FFI target (tests register the portable build
    under another name)."""
    if w.ndim != 2 or jnp.dtype(w.dtype) not in map(jnp.dtype, WEIGHT_DTYPES):
        raise ValueError(f"the native float matmul takes a 2-D float32 or bfloat16 weight, got "
                         f"{w.dtype} {w.shape}")
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the weight's K = {k}")
    native.load()
    lead = x.shape[:-1]
    m = math.prod(lead)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))
    y = call(x.reshape(m, k).astype(jnp.float32), w, transposed=np.int32(transposed))  # [M, N]
    return y.reshape(*lead, n)


def float_matmul_reference(x, w, transposed: bool = False) -> np.ndarray:
    """numpy, float64: x [M, K] @ w ([K, N], or [N, K] transposed), weights as stored (a
    bfloat16 weight's values exactly)."""
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    return x64 @ (w64.T if transposed else w64)


def error_bound(x, w, transposed: bool = False) -> np.ndarray:
    """The float32-accumulation bound on |y - exact| per output: gamma_K sum_k |x w| with
    gamma_K = K u / (1 - K u), u = 2^-24 (any summation order of K products and sums;
    Higham, Accuracy and Stability, 3.1)."""
    k = np.shape(x)[-1]
    u = 2.0 ** -24
    gamma = (k + 1) * u / (1 - (k + 1) * u)  # + 1: the product's own rounding
    return gamma * float_matmul_reference(np.abs(np.asarray(jnp.asarray(x, jnp.float32))),
                                          np.abs(np.asarray(jnp.asarray(w, jnp.float32))),
                                          transposed)
