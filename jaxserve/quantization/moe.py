"""w8a16 for mixture-of-experts models: each expert's kernels quantized like a Linear's.

The stacked expert kernels (models/moe.py: gate/up `[L, E, D, F]`, down `[L, E, F, D]`) are
quantized expert by expert with round-to-nearest, int8 symmetric per output channel
(INT8_CHANNEL), into one Int8Weight per kernel name with leading `[L, E]` axes. The MoE MLP
runs them through ragged_dot with the codes converted in the step (exact) and the scales
applied per row. Other paths (int4, W8A8, GGUF) are refused for MoE models (paths.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.quantization.core import QuantSpec
from jaxserve.quantization.rtn import rtn_weight

EXPERT_KERNELS = ("gate", "up", "down")


@functools.partial(jax.jit, static_argnames="spec")
def _rtn_experts(w, spec: QuantSpec):
    one = functools.partial(rtn_weight, spec=spec)
    return jax.vmap(jax.vmap(one))(w)  # over layers, then experts


def quantize_experts(params: dict, spec: QuantSpec) -> dict:
    """params with every stacked expert kernel replaced by its RTN Int8Weight."""
    mlp = params["layers"]["mlp"]
    quantized = {name: _rtn_experts(jnp.asarray(mlp[name], jnp.float32), spec)
                 for name in EXPERT_KERNELS}
    return dict(params, layers=dict(params["layers"], mlp=dict(mlp, **quantized)))
