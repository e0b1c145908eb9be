"""The multi-LoRA delta of one projection for a batch of tokens in any order, each token with its
own adapter slot: `kernel_lora_delta()` (the Pallas SGMV kernel, pallas_kernels/lora.py) and
`xla_lora_delta_reference` (a per-token gather, the oracle in tests).

    delta(x, a, b, token_slots) -> y
    x [T, K], a [S, K, R], b [S, R, N], token_slots [T] int32 -> y float32 [T, N]
    y[t] = (x[t] @ a[slot[t]]) @ b[slot[t]], zeros where slot[t] is -1 (no adapter)

Slots outside 0..S-1 are treated as -1. The kernel wants rows sorted by slot, so the wrapper
sorts the tokens on the device (a stable argsort, tokens of no adapter last, where the kernel
makes no work for them), counts each slot's tokens, runs the kernel on the sorted rows and
scatters the result back to token order. A projection the kernel cannot tile (K or N not a
multiple of 16) runs the same tiling in plain XLA (`lora_sgmv_xla`) instead, said in a log line.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from models.lora import LoRABackend
from pallas_kernels.lora import kernel_unsupported, lora_sgmv, lora_sgmv_xla

log = logging.getLogger("jaxserve")

Delta = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def sort_by_slot(token_slots, num_slots: int):
    """(order [T] int32: the tokens by slot, stable, no-adapter tokens last; group_sizes [S]
    int32: tokens per slot). Slots outside 0..S-1 count as no adapter."""
    slots = token_slots.astype(jnp.int32)
    key = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)  # [T]: S = none
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # [T]
    one_hot = key[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None, :]  # [T, S]
    return order, jnp.sum(one_hot, axis=0, dtype=jnp.int32)


def kernel_lora_backend(interpret: bool = False) -> LoRABackend:
    """The engine's kernel backend (models/lora.py LoRABackend): the tokens sorted by slot once
    per step (`index`: order and group sizes), the Pallas kernel in every adapted linear
    (`interpret`: through the Pallas interpreter, for CPUs and tests), or the tiled XLA path
    for shapes the kernel cannot tile."""

    def delta(x, a, b, index, on=None):
        del on  # the kernel does no work for rows of no slot; zero slots cost their reads
        order, sizes = index
        a = jnp.transpose(a, (1, 0, 2))  # the slots' K-major [K, S, R] as the kernel reads it
        k, n = x.shape[1], b.shape[2]
        why = kernel_unsupported(k, n)
        if why:
            log.info("LoRA kernel cannot run [%d] x [%d] (%s): tiled XLA path", k, n, why)
            sgmv = lora_sgmv_xla
        else:
            def sgmv(*args):
                return lora_sgmv(*args, interpret=interpret)
        y_sorted = sgmv(x[order], a, b, sizes)  # [T, N], rows in slot order
        return jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)  # [T, N]

    return LoRABackend(delta=delta, index=sort_by_slot)


def kernel_lora_delta(interpret: bool = False) -> Delta:
    """`kernel_lora_backend` as one function of the token slots (sorting in every call)."""
    backend = kernel_lora_backend(interpret)

    def delta(x, a, b, token_slots):
        k_major = jnp.transpose(a, (1, 0, 2))  # [K, S, R], as the engine stores slots
        return backend.delta(x, k_major, b, backend.index(token_slots, a.shape[0]))

    return delta


def xla_lora_delta_reference(x, a, b, token_slots):
    """Each token's a and b gathered by its slot, no sorting: the oracle for `kernel_lora_delta`
    (same arguments and result). f32 products at HIGHEST precision; bf16 inputs get the shrink's
    result rounded to bf16 before the expand, as the kernel does."""
    s = a.shape[0]
    slots = token_slots.astype(jnp.int32)
    live = (slots >= 0) & (slots < s)  # [T]
    idx = jnp.where(live, slots, 0)
    f32, hp = jnp.float32, lax.Precision.HIGHEST
    a_t = a.astype(x.dtype).astype(f32)[idx]  # [T, K, R]
    b_t = b.astype(x.dtype).astype(f32)[idx]  # [T, R, N]
    h = jnp.einsum("tk,tkr->tr", x.astype(f32), a_t, precision=hp)  # [T, R]
    y = jnp.einsum("tr,trn->tn", h.astype(x.dtype).astype(f32), b_t, precision=hp)  # [T, N]
    return jnp.where(live[:, None], y, 0.0)
