"""Weight quantization of a loaded model's params (round-to-nearest int4 for now)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.int4_matmul import quantize_int4

# The decoder's linear layers, stacked over layers as [L, K, N] kernels.
_LINEARS = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def pick_group_size(k: int, preferred: int = 128) -> int:
    """The largest of preferred, 64, 32 that divides K (SmolLM2's 576 takes 64, not 128)."""
    for g in (preferred, 64, 32):
        if g <= preferred and k % g == 0:
            return g
    raise ValueError(f"input dimension {k} is not a multiple of 32: cannot group-quantize it")


def quantize_params_int4(params: dict, group_size: int = 128, symmetric: bool = False) -> dict:
    """Replaces every decoder linear kernel with {packed, scales, offsets} (RTN, per group).

    Embedding and LM head stay in floating point, as in most W4A16 deployments.
    """
    layers = dict(params["layers"])
    for block, name in _LINEARS:
        w = jnp.asarray(params["layers"][block][name]["kernel"], jnp.float32)  # [L, K, N]
        g = pick_group_size(w.shape[1], group_size)
        quantize = functools.partial(quantize_int4, group_size=g, symmetric=symmetric)
        packed, scales, offsets = jax.vmap(quantize)(w)  # over layers: [L, K/2, N], [L, K/g, N]
        q = {"packed": packed, "scales": scales}
        if not symmetric:
            q["offsets"] = offsets
        layers[block] = dict(layers[block])
        layers[block][name] = dict(layers[block][name], kernel=q)
    return dict(params, layers=layers)
