"""Maps checkpoint tensors (HF names and layouts) onto the Flax parameter tree.

Every loader (GGUF, HF safetensors) first produces tensors under transformers' names with
transformers' layouts (Linear weights `[out, in]`), so this one mapping serves them all.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from models import windowed
from models.config import ModelConfig
from models.moe_weights import (moe_hf_shapes, moe_param_shapes,  # MoE experts
                                moe_params_from_hf)

# Flax path inside a layer -> (HF name template, transpose?)
_LAYER_TENSORS = {
    ("input_norm", "scale"): ("model.layers.{i}.input_layernorm.weight", False),
    ("post_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", False),
    ("attn", "q_proj", "kernel"): ("model.layers.{i}.self_attn.q_proj.weight", True),
    ("attn", "k_proj", "kernel"): ("model.layers.{i}.self_attn.k_proj.weight", True),
    ("attn", "v_proj", "kernel"): ("model.layers.{i}.self_attn.v_proj.weight", True),
    ("attn", "o_proj", "kernel"): ("model.layers.{i}.self_attn.o_proj.weight", True),
    ("mlp", "gate_proj", "kernel"): ("model.layers.{i}.mlp.gate_proj.weight", True),
    ("mlp", "up_proj", "kernel"): ("model.layers.{i}.mlp.up_proj.weight", True),
    ("mlp", "down_proj", "kernel"): ("model.layers.{i}.mlp.down_proj.weight", True),
}
_BIAS_TENSORS = {
    ("attn", "q_proj", "bias"): "model.layers.{i}.self_attn.q_proj.bias",
    ("attn", "k_proj", "bias"): "model.layers.{i}.self_attn.k_proj.bias",
    ("attn", "v_proj", "bias"): "model.layers.{i}.self_attn.v_proj.bias",
}


# Gemma's sandwich norms: HF's post_attention_layernorm follows attention (our post_attn_norm)
# and pre_feedforward_layernorm is the pre-MLP norm that Llama calls post_attention_layernorm.
_GEMMA_NORMS = {
    ("post_attn_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", False),
    ("post_norm", "scale"): ("model.layers.{i}.pre_feedforward_layernorm.weight", False),
    ("post_mlp_norm", "scale"): ("model.layers.{i}.post_feedforward_layernorm.weight", False),
}


def _layer_tensors(config: ModelConfig) -> dict:
    """Flax path inside a layer -> (HF name template, transpose?) for this architecture."""
    if config.architecture in windowed.GEMMA:
        return {**_LAYER_TENSORS, **_GEMMA_NORMS}
    return _LAYER_TENSORS


def _qk_norm_tensors(config: ModelConfig) -> dict:
    """q/k norm scales (Qwen3: per head `[Dh]`; OLMoE: whole projection `[H * Dh]`)."""
    if config.qk_norm == "none":
        return {}
    return {("attn", "q_norm", "scale"): ("model.layers.{i}.self_attn.q_norm.weight", False),
            ("attn", "k_norm", "scale"): ("model.layers.{i}.self_attn.k_norm.weight", False)}


def _layer_items(config: ModelConfig) -> list[tuple[tuple[str, ...], str, bool]]:
    """(Flax path, HF name template, transpose?) of every per-layer tensor of `config`."""
    items = [(path, tmpl, tr) for path, (tmpl, tr) in _layer_tensors(config).items()]
    if config.attention_bias:
        items += [(path, tmpl, False) for path, tmpl in _BIAS_TENSORS.items()]
    items += [(path, tmpl, tr) for path, (tmpl, tr) in _qk_norm_tensors(config).items()]
    if config.num_experts:  # the experts replace the dense MLP (models/moe_weights.py)
        items = [item for item in items if item[0][0] != "mlp"]
    return items


class CheckpointError(ValueError):
    """A checkpoint is unreadable, incomplete or does not match its config."""


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must hold, with its HF shape."""
    c = config
    d, f = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    per_layer = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    if c.architecture in windowed.GEMMA:
        per_layer.update({"pre_feedforward_layernorm.weight": (d,),
                          "post_feedforward_layernorm.weight": (d,)})
    if c.attention_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if c.num_experts:  # the experts replace the dense MLP (models/moe_weights.py)
        per_layer = {k: v for k, v in per_layer.items() if not k.startswith("mlp.")}
    if c.qk_norm != "none":
        per_head = c.qk_norm == "per_head"
        per_layer.update({"self_attn.q_norm.weight": (c.head_dim if per_head else q,),
                          "self_attn.k_norm.weight": (c.head_dim if per_head else kv,)})
    for i in range(c.num_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}"] = shape
    return shapes | moe_hf_shapes(c)


# Fused projections some families store (Phi-3), split at load time into the q/k/v and
# gate/up layers every other path (quantization, tensor-parallel roles, kernels) knows.
_FUSED = {"phi3": ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")}


def file_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint file for `config` holds under its own names (fused or not)."""
    shapes = expected_hf_shapes(config)
    if config.architecture not in _FUSED:
        return shapes
    c = config
    q, kv, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        for part in ("q_proj", "k_proj", "v_proj"):
            del shapes[f"{pre}self_attn.{part}.weight"]
        for part in ("gate_proj", "up_proj"):
            del shapes[f"{pre}mlp.{part}.weight"]
        shapes[f"{pre}self_attn.qkv_proj.weight"] = (q + 2 * kv, c.hidden_size)
        shapes[f"{pre}mlp.gate_up_proj.weight"] = (2 * f, c.hidden_size)
    return shapes


# The smallest weights any loader reads are 4-bit blocks (Q4_0, Q4_K: 4.5 bits per value); half
# of that, so that a file missing a tensor or two still gets the per-tensor message.
MIN_BYTES_PER_PARAM = 0.25


def check_fits_files(config: ModelConfig, num_layers_found: int, num_bytes: int,
                     source: str) -> None:
    """Refuses a config its files cannot hold, before anything is sized from it.

    A corrupt or hostile header can claim billions of layers or a vocabulary of 10**12; sizing
    name tables or buffers from it would hang or exhaust memory, while the layers the files
    hold tensors for and their bytes bound what a real checkpoint for the config has.
    """
    if config.num_layers > num_layers_found:
        raise CheckpointError(
            f"{source}: the config describes {config.num_layers:,} layers but the file holds "
            f"tensors for {num_layers_found}; its metadata is wrong or it is incomplete")
    need = int(config.num_params() * MIN_BYTES_PER_PARAM)
    if need > num_bytes:
        raise CheckpointError(
            f"{source}: the config describes {config.num_params():,} parameters, more than "
            f"its {num_bytes:,} bytes can hold; its metadata is wrong or it is truncated")


def layer_indices(names, prefix: str) -> set[int]:
    """The layer numbers N in tensor names `prefix`N.<rest> (blk. for GGUF, model.layers.)."""
    found = set()
    for name in names:
        if name.startswith(prefix):
            head = name[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    return found


def unfuse(tensors: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named tensors with fused qkv_proj / gate_up_proj (`[out, in]`) split into the
    separate projections, in transformers' order (q, k, v; gate, up)."""
    if config.architecture not in _FUSED:
        return dict(tensors)
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = dict(tensors)
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        qkv = out.pop(f"{pre}self_attn.qkv_proj.weight")  # [q + 2 kv, D]
        out[f"{pre}self_attn.q_proj.weight"] = qkv[:q]
        out[f"{pre}self_attn.k_proj.weight"] = qkv[q:q + kv]
        out[f"{pre}self_attn.v_proj.weight"] = qkv[q + kv:]
        gate_up = out.pop(f"{pre}mlp.gate_up_proj.weight")  # [2 F, D]
        out[f"{pre}mlp.gate_proj.weight"] = gate_up[:c.intermediate_size]
        out[f"{pre}mlp.up_proj.weight"] = gate_up[c.intermediate_size:]
    return out


def check_tensors(get_shape: Callable[[str], tuple[int, ...] | None], config: ModelConfig,
                  source: str, shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Raises CheckpointError naming the file and tensor for a missing or misshapen tensor
    (of `shapes`, default the unfused `expected_hf_shapes`)."""
    for name, shape in (expected_hf_shapes(config) if shapes is None else shapes).items():
        found = get_shape(name)
        if found is None:
            raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        if tuple(found) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(found)}, the "
                                  f"config implies {shape}")


def params_from_hf(tensors: Mapping[str, np.ndarray], config: ModelConfig, dtype,
                   source: str = "checkpoint") -> dict:
    """Builds the Flax params tree (numpy, `dtype`) from HF-named tensors."""
    check_tensors(lambda n: tensors[n].shape if n in tensors else None, config, source)

    def get(name, transpose=False):
        x = np.asarray(tensors[name])
        return np.ascontiguousarray(x.T if transpose else x).astype(dtype)

    layers: dict = {}
    if config.num_experts:  # the experts (models/moe_weights.py)
        layers["mlp"] = moe_params_from_hf(get, config)
    for path, tmpl, transpose in _layer_items(config):
        # [L, ...]: layers are stacked for nn.scan.
        stacked = np.stack([get(tmpl.format(i=i), transpose) for i in range(config.num_layers)])
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = stacked
    params = {"embedding": get("model.embed_tokens.weight"), "layers": layers,
              "final_norm": {"scale": get("model.norm.weight")}}
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight", transpose=True)}
    return params


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every leaf `params_from_hf` builds, by "/"-joined Flax path."""
    hf = expected_hf_shapes(config)
    shapes = moe_param_shapes(config)
    for path, tmpl, transpose in _layer_items(config):
        one = hf[tmpl.format(i=0)]
        shapes["/".join(("layers",) + path)] = (config.num_layers,
                                                 *(one[::-1] if transpose else one))
    shapes["embedding"] = hf["model.embed_tokens.weight"]
    shapes["final_norm/scale"] = hf["model.norm.weight"]
    if not config.tie_word_embeddings:
        shapes["lm_head/kernel"] = hf["lm_head.weight"][::-1]
    return shapes
