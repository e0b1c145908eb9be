"""Random LoRA adapters written in PEFT's file format for a tiny model, and the same adapter
merged into the base weights (`W + scale * A^T B^T`, the reference tests compare against)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from models.lora import MODULE_PARENT, module_shapes

# PEFT's module paths under a Llama-family model.
_PEFT_PARENT = {"attn": "self_attn", "mlp": "mlp"}


def peft_key(layer: int, module: str, which: str) -> str:
    """The safetensors key of `which` ("lora_A" / "lora_B") of a module in PEFT's format."""
    parent = _PEFT_PARENT[MODULE_PARENT[module]]
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.{which}.weight"


def write_adapter(directory, config, *, rank: int, targets, seed: int, alpha: float | None = None,
                  use_rslora: bool = False, std: float = 0.2) -> dict:
    """Writes adapter_config.json + adapter_model.safetensors (random A and non-zero B) for
    `config`'s layers; returns {module: (A [L, r, K], B [L, N, r])} as written (PEFT's
    [out, in] orientation)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes, tensors, written = module_shapes(config), {}, {}
    for module in targets:
        k, n = shapes[module]
        a = (rng.standard_normal((config.num_layers, rank, k)) * std).astype(np.float32)
        b = (rng.standard_normal((config.num_layers, n, rank)) * std).astype(np.float32)
        written[module] = (a, b)
        for layer in range(config.num_layers):
            tensors[peft_key(layer, module, "lora_A")] = a[layer]  # [r, K]
            tensors[peft_key(layer, module, "lora_B")] = b[layer]  # [N, r]
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets), "bias": "none", "use_rslora": use_rslora,
        "task_type": "CAUSAL_LM"}))
    return written


def scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    return alpha / (rank ** 0.5 if use_rslora else rank)


def merged_params(params: dict, written: dict, scale: float) -> dict:
    """Stacked float params with each adapted kernel [L, K, N] replaced by W + scale * A^T B^T."""
    layers = {k: dict(v) for k, v in params["layers"].items()}
    for module, (a, b) in written.items():
        parent = MODULE_PARENT[module]
        node = dict(layers[parent][module])
        kernel = np.asarray(node["kernel"], np.float64)
        delta = np.einsum("lrk,lnr->lkn", a.astype(np.float64), b.astype(np.float64)) * scale
        node["kernel"] = (kernel + delta).astype(np.asarray(node["kernel"]).dtype)
        layers[parent][module] = node
    return {**params, "layers": layers}
