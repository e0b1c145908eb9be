"""HF checkpoint names and layouts of the MoE MLP's tensors, and their stacked Flax params.

models/weights.py calls these for a MoE config in place of the dense MLP's three tensors.
transformers (5.x) holds experts fused in memory but `save_pretrained` writes them per expert,
as the published Mixtral / Qwen3-MoE / OLMoE checkpoints are:
    Mixtral      model.layers.{i}.block_sparse_moe.gate.weight            [E, D]
                 model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight  [F, D]  (gate)
                 ...experts.{j}.w3.weight [F, D] (up), ...experts.{j}.w2.weight [D, F] (down)
    Qwen3-MoE,   model.layers.{i}.mlp.gate.weight                         [E, D]
    OLMoE        model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight
Flax (models/moe.py, under the scanned "layers"): mlp/router [L, D, E], mlp/gate and mlp/up
[L, E, D, F], mlp/down [L, E, F, D].
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# architecture -> (router, gate, up, down) name templates inside layer i, expert j.
_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight",
                "block_sparse_moe.experts.{j}.w2.weight"),
}
_NAMES["qwen3_moe"] = _NAMES["olmoe"] = (
    "mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
    "mlp.experts.{j}.down_proj.weight")


def _names(config, i: int, j: int) -> tuple[str, str, str, str]:
    if config.architecture not in _NAMES:
        raise ValueError(f"no MoE tensor names for architecture {config.architecture!r}")
    return tuple(f"model.layers.{i}." + t.format(j=j) for t in _NAMES[config.architecture])


def moe_hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every MoE tensor of a checkpoint for `config`, with its HF shape ({} if dense)."""
    if not config.num_experts:
        return {}
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes = {}
    for i in range(config.num_layers):
        for j in range(e):
            router, gate, up, down = _names(config, i, j)
            shapes.update({router: (e, d), gate: (f, d), up: (f, d), down: (d, f)})
    return shapes


def moe_params_from_hf(get: Callable[[str, bool], np.ndarray], config) -> dict:
    """The stacked "mlp" params from HF tensors; `get(name, transpose)` reads one tensor."""
    layers = range(config.num_layers)
    experts = range(config.num_experts)

    def stack(which: int):  # [L, E, in, out]
        return np.stack([np.stack([get(_names(config, i, j)[which], True) for j in experts])
                         for i in layers])

    router = np.stack([get(_names(config, i, 0)[0], True) for i in layers])  # [L, D, E]
    return {"router": router, "gate": stack(1), "up": stack(2), "down": stack(3)}


def moe_param_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shape of every MoE leaf `moe_params_from_hf` builds, by "/"-joined Flax path."""
    if not config.num_experts:
        return {}
    n, e, d, f = (config.num_layers, config.num_experts, config.hidden_size,
                  config.moe_intermediate_size)
    return {"layers/mlp/router": (n, d, e), "layers/mlp/gate": (n, e, d, f),
            "layers/mlp/up": (n, e, d, f), "layers/mlp/down": (n, e, f, d)}
