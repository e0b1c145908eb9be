"""Round-to-nearest quantization of a loaded model's linear kernels onto the core pytree."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.quantization.core import QuantSpec, quantize, to_weight
from models.quantized import QuantizedWeight

# The decoder's linear layers, stacked over layers as [L, K, N] kernels, and their HF names.
LINEARS = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
HF_LINEARS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight")


def pick_group_size(k: int, preferred: int = 128) -> int:
    """The largest of preferred, 64, 32 that divides K (SmolLM2's 576 takes 64, not 128)."""
    for g in (preferred, 64, 32):
        if g <= preferred and k % g == 0:
            return g
    raise ValueError(f"input dimension {k} is not a multiple of 32: cannot group-quantize it")


def spec_for(spec: QuantSpec, k: int) -> QuantSpec:
    """spec with its group size lowered to one that divides K (per channel/tensor: as is)."""
    if spec.granularity != "group":
        return spec
    return dataclasses.replace(spec, group_size=pick_group_size(k, spec.group_size))


@functools.partial(jax.jit, static_argnames="spec")
def rtn_weight(w, spec: QuantSpec) -> QuantizedWeight:
    """w [K, N] -> its quantized weight by round-to-nearest."""
    return to_weight(*quantize(w, spec), spec)


@functools.partial(jax.jit, static_argnames="spec")
def _rtn_stacked(w, spec: QuantSpec) -> QuantizedWeight:
    return jax.vmap(functools.partial(rtn_weight, spec=spec))(w)  # over layers


def quantize_kernels(params: dict, spec: QuantSpec) -> dict:
    """Replaces every decoder linear kernel [L, K, N] with its RTN weight (one vmap per name)."""
    layers = {block: dict(params["layers"][block]) for block in params["layers"]}
    for block, name in LINEARS:
        if name not in params["layers"][block]:
            continue  # a MoE layer's MLP is its experts (quantization/moe.py)
        w = jnp.asarray(params["layers"][block][name]["kernel"], jnp.float32)  # [L, K, N]
        q = _rtn_stacked(w, spec_for(spec, w.shape[1]))
        layers[block][name] = dict(layers[block][name], kernel=q)
    return dict(params, layers=layers)


def head_kernel(params: dict):
    """The LM head as a [D, V] kernel: its own, or the tied embedding transposed."""
    if "lm_head" in params:
        return params["lm_head"]["kernel"]
    return jnp.asarray(params["embedding"]).T


def quantize_head(params: dict, spec: QuantSpec) -> dict:
    """Adds (or replaces) params["lm_head"] with the RTN weight of the head.

    A tied head gets its own quantized copy; the embedding lookup keeps the float table.
    """
    w = jnp.asarray(head_kernel(params), jnp.float32)  # [D, V]
    return dict(params, lm_head={"kernel": rtn_weight(w, spec_for(spec, w.shape[0]))})


def rtn(model, spec: QuantSpec, calibration=None) -> dict:
    """The method registry's RTN entry: needs no calibration data."""
    del calibration
    return quantize_kernels(model.params, spec)


def quantize_params_int4(params: dict, group_size: int = 128, symmetric: bool = False) -> dict:
    """W4A16 RTN of the decoder linears (groups of 128, or 64/32 where 128 does not divide K)."""
    return quantize_kernels(params, QuantSpec(bits=4, granularity="group",
                                              group_size=group_size, symmetric=symmetric))
