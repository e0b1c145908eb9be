"""Where a decoder's layer weights live: stacked `[L, ...]` under "layers" (the layer scan reads
them so) or split into per-layer trees "layers_i" (what `Llama(unroll_layers=True)` reads), or
both at once: the unrolled CPU step keeps the native matmul's packed weights and the norms
stacked, and `layer_views` hands each layer its share inside the step without a copy."""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import traverse_util

from models.quantized import CpuPackedWeight


def layer_name(i: int) -> str:
    """Layer i's params key when the layers are unrolled (stacked: all under "layers")."""
    return f"layers_{i}"


def _is_packed(x) -> bool:
    return isinstance(x, CpuPackedWeight)


def _split_tree(tree: dict, keep: Callable[[tuple, Any], bool]) -> tuple[dict, dict]:
    """(the leaves `keep` rejects, the leaves it keeps), as two trees of the same nesting."""
    flat = traverse_util.flatten_dict(tree)
    kept = {path for path, leaf in flat.items() if keep(path, leaf)}
    return (traverse_util.unflatten_dict({p: v for p, v in flat.items() if p not in kept}),
            traverse_util.unflatten_dict({p: flat[p] for p in kept}))


def unstack_layers(params: dict, num_layers: int,
                   keep: Callable[[tuple, Any], bool] | None = None) -> dict:
    """Params with the stacked "layers" `[L, ...]` split into L per-layer trees (what
    `unroll_layers` reads); arrays are copied once, ShapeDtypeStructs stay abstract.

    keep(path, leaf): leaves left stacked under "layers" (path: keys inside a layer, e.g.
    ("attn", "q_proj", "kernel")), which `layer_views` hands each layer inside the step
    without a copy; it saves the step call a buffer per layer for each of them."""
    if "layers" not in params or layer_name(0) in params:  # nothing stacked, or done
        return params
    def take(i):
        return lambda a: (jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                          if isinstance(a, jax.ShapeDtypeStruct) else a[i])
    split, kept = (_split_tree(params["layers"], keep) if keep is not None
                   else (params["layers"], {}))
    rest = {k: v for k, v in params.items() if k != "layers"}
    per_layer = {layer_name(i): jax.tree.map(take(i), split) for i in range(num_layers)}
    return {**rest, **per_layer, **({"layers": kept} if kept else {})}


def layer_views(params: dict, num_layers: int) -> dict:
    """Inside a step: params unstacked with `keep` (unstack_layers) as `unroll_layers` reads
    them, each layer's share of the stacked leaves merged into its tree: packed weights as
    views of the stack (CpuPackedWeight.at_layer: the native kernel reads them in place),
    other arrays sliced (small vectors the fusions that use them read in place)."""
    if "layers" not in params or layer_name(0) not in params:
        return params  # all stacked (the scan) or all per layer
    stacked = params["layers"]
    def view(i):
        return lambda a: a.at_layer(i) if _is_packed(a) else a[i]
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        name = layer_name(i)
        share = jax.tree.map(view(i), stacked, is_leaf=_is_packed)
        out[name] = traverse_util.unflatten_dict({**traverse_util.flatten_dict(out[name]),
                                                  **traverse_util.flatten_dict(share)})
    return out
