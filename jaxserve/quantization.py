"""Weight quantization of a loaded model's params (round-to-nearest int4 for now)."""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels.int4_matmul import quantize_int4

QUANTIZATIONS = ("int4",)
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
        w = params["layers"][block][name]["kernel"]  # [L, K, N]
        g = pick_group_size(w.shape[1], group_size)
        parts = [quantize_int4(jax.numpy.asarray(w[i], np.float32), group_size=g,
                               symmetric=symmetric) for i in range(w.shape[0])]
        q = {"packed": np.stack([np.asarray(p[0]) for p in parts]),  # [L, K/2, N] uint8
             "scales": np.stack([np.asarray(p[1]) for p in parts])}  # [L, K/g, N]
        if not symmetric:
            q["offsets"] = np.stack([np.asarray(p[2]) for p in parts])  # [L, K/g, N]
        layers[block] = dict(layers[block])
        layers[block][name] = dict(layers[block][name], kernel=q)
    return dict(params, layers=layers)
