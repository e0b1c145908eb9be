"""LoRA adapters inside the model: device slots of adapter weights and the per-token delta.

An engine serving adapters keeps `S = max_loras` device slots per adapted linear, stored beside
its kernel in the params tree: `lora_a [K, S, R]` and `lora_b [S, R, N]` (R = max_lora_rank;
an adapter of smaller rank is zero-padded, its scaling folded into B), stacked `[L, ...]` like
every layer weight; A is K-major so that every slot's A is one `[K, S * R]` matrix, the
XLA path's shrink. Loading an adapter writes one slot; the shapes never change, so nothing
recompiles. Each token of a step carries the slot of its sequence's adapter (`token_slots [T]`,
-1 for none), and every adapted `Linear` adds

    delta[t] = (x[t] @ lora_a[slot[t]]) @ lora_b[slot[t]]      (0 when slot[t] = -1)

through a `LoRAFn` backend: `dense_lora_delta` here (XLA, the CPU path), a segmented Pallas
kernel on GPU (jaxserve/runtime/lora.py).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

# Plain-Python facts about adapters, kept free of jax (models/lora_names.py).
from models.lora_names import MODULE_PARENT, module_shapes  # noqa: F401 (re-exported)

# (x [T, K], lora_a [K, S, R], lora_b [S, R, N], index, lora_on [S]) -> delta [T, N] float32,
# where index is what the backend's `index` made of the step's token slots (here: the slots
# themselves) and lora_on says which slots adapt this layer.
LoRAFn = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray, Any, Any], jnp.ndarray]


class LoRABackend(NamedTuple):
    """How adapted linears add their delta: `index(token_slots [T], num_slots)` runs once per
    step (a kernel backend sorts the tokens by slot there, not in each of the L x 7 linears),
    `delta(x, a, b, index)` in every adapted linear."""

    delta: LoRAFn
    index: Callable[[jnp.ndarray, int], Any]

NO_ADAPTER = -1  # a token slot meaning "the base model"


def dense_lora_delta(x, a, b, token_slots, on=None):
    """The XLA path: shrink x against every slot in one matmul (`[T, K] x [K, S * R]`, a's
    K-major layout), zero the other slots' columns, expand in one matmul (`[T, S * R] x
    [S * R, N]`). S * R columns cost `S * R * (K + N)` per token, and decode steps read every
    slot's weights anyway: two plain products beat a per-token gather of weights (T * K * R
    bytes) and any sorting on XLA:CPU. `on` (which slots adapt this layer) is not needed:
    slots that do not hold zeros."""
    del on
    k, num_slots, r = a.shape
    h = jnp.dot(x, a.reshape(k, num_slots * r).astype(x.dtype),
                preferred_element_type=jnp.float32).reshape(-1, num_slots, r)  # [T, S, R]
    mine = token_slots[:, None] == jnp.arange(num_slots, dtype=token_slots.dtype)  # [T, S]
    h = jnp.where(mine[:, :, None], h, 0.0).astype(x.dtype).reshape(-1, num_slots * r)
    return jnp.dot(h, b.reshape(num_slots * r, -1).astype(x.dtype),
                   preferred_element_type=jnp.float32)  # [T, N]


def slots_index(token_slots, num_slots: int):
    """The XLA path's per-step index: the token slots as they are."""
    del num_slots
    return token_slots


# The XLA path without conditionals (a GPU program under tensor parallelism: a conditional
# would make the host wait for the device mid-step).
DENSE = LoRABackend(dense_lora_delta, slots_index)


def skipping_index(token_slots, num_slots: int):
    """The token slots, once per step (each adapted linear asks its own question of them)."""
    del num_slots
    return token_slots


def skipping_lora_delta(x, a, b, token_slots, on=None):
    """`dense_lora_delta`, skipped (zeros) where no token of the step has an adapter that
    adapts this layer (`on [S]`: which slots do; None: every slot): the base model's requests,
    and adapters of other targets or layers, then pay nothing for these slots (the CPU path)."""
    live = token_slots >= 0
    if on is not None:
        live = live & (jnp.take(on, jnp.maximum(token_slots, 0)) != 0)
    n = b.shape[-1]
    return lax.cond(jnp.any(live), lambda: dense_lora_delta(x, a, b, token_slots),
                    lambda: jnp.zeros((x.shape[0], n), jnp.float32))


# The CPU's XLA path.
SKIPPING = LoRABackend(skipping_lora_delta, skipping_index)

# The params each adapted linear holds beside its kernel.
SLOT_LEAVES = ("lora_a", "lora_b", "lora_on")


def apply_lora(y, x, slots, index, lora_fn: LoRAFn):
    """y [..., N] (the base projection, float32) plus each token's adapter delta; slots: the
    linear's (lora_a, lora_b, lora_on)."""
    a, b, on = slots
    flat = x.reshape(-1, x.shape[-1])  # [T, K]
    delta = lora_fn(flat, a, b, index, on)  # [T, N]
    return y + delta.reshape(*y.shape[:-1], delta.shape[-1]).astype(y.dtype)


def slot_arrays(config, targets, max_loras: int, max_rank: int, dtype) -> dict:
    """Zeroed slots for every target: {module: (a [L, K, S, R], b [L, S, R, N], on [L, S])} as
    numpy; `on` says which slots adapt the layer (int32 0/1)."""
    shapes, layers = module_shapes(config), config.num_layers
    out = {}
    for name in targets:
        k, n = shapes[name]
        out[name] = (np.zeros((layers, k, max_loras, max_rank), dtype),  # [L, K, S, R]
                     np.zeros((layers, max_loras, max_rank, n), dtype),  # [L, S, R, N]
                     np.zeros((layers, max_loras), np.int32))            # [L, S]
    return out


def with_slots(params: dict, slots: dict) -> dict:
    """params (stacked "layers") with each target's slot arrays put beside its kernel."""
    layers = dict(params["layers"])
    for name, arrays in slots.items():
        parent = dict(layers[MODULE_PARENT[name]])
        parent[name] = {**parent[name], **dict(zip(SLOT_LEAVES, arrays))}
        layers[MODULE_PARENT[name]] = parent
    return {**params, "layers": layers}


def slot_leaves(params: dict, num_layers: int) -> dict:
    """{(module, layer or None): (lora_a, lora_b, lora_on)} of params, stacked ("layers":
    layer None) or unrolled ("layers_i")."""
    found = {}
    # Unrolled params may keep some leaves stacked under "layers" too (layer_layout.layer_views).
    keys = [k for k in ("layers", *(f"layers_{i}" for i in range(num_layers))) if k in params]
    for key in keys:
        layer = None if key == "layers" else int(key.removeprefix("layers_"))
        for name, parent in MODULE_PARENT.items():
            node = params.get(key, {}).get(parent, {}).get(name, {})
            if "lora_a" in node:
                found[(name, layer)] = tuple(node[leaf] for leaf in SLOT_LEAVES)
    return found


def replace_slot_leaves(params: dict, leaves: dict) -> dict:
    """params with the (module, layer) -> slot arrays of `leaves` swapped in; every other leaf
    is the same object (no copy)."""
    out = dict(params)
    for (name, layer), arrays in leaves.items():
        key = "layers" if layer is None else f"layers_{layer}"
        parent_key = MODULE_PARENT[name]
        layer_tree = dict(out[key])
        parent = dict(layer_tree[parent_key])
        parent[name] = {**parent[name], **dict(zip(SLOT_LEAVES, arrays))}
        layer_tree[parent_key] = parent
        out[key] = layer_tree
    return out


def write_slot(leaves: dict, slot, weights: dict) -> dict:
    """leaves (slot_leaves' dict) with slot `slot` (an int32 scalar) set to `weights` {module:
    (A [L, K, R], B [L, R, N])}, one entry per module of `leaves` (zeros for a module the
    adapter does not target: the same tree for every adapter, so one compiled program), and
    each layer's `on` flag set where the adapter's B is not all zeros. Jitted with `leaves`
    donated (jaxserve/runtime/lora.py)."""
    out = {}
    for (name, layer), (a, b, on) in leaves.items():
        wa, wb = weights[name]
        adapts = jnp.any(wb != 0, axis=(1, 2)).astype(on.dtype)  # [L]
        if layer is None:
            out[(name, layer)] = (a.at[:, :, slot].set(wa.astype(a.dtype)),  # [L, K, S, R]
                                  b.at[:, slot].set(wb.astype(b.dtype)),     # [L, S, R, N]
                                  on.at[:, slot].set(adapts))                # [L, S]
        else:
            out[(name, layer)] = (a.at[:, slot].set(wa[layer].astype(a.dtype)),
                                  b.at[slot].set(wb[layer].astype(b.dtype)),
                                  on.at[slot].set(adapts[layer]))
    return out
