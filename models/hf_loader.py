"""Loads a transformers checkpoint directory: config.json + *.safetensors (single or sharded)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import SafetensorError, safe_open

from models.config import ModelConfig
from models.weights import (CheckpointError, check_fits_files, check_tensors, file_shapes,
                            layer_indices, unfuse)


def read_hf_config(directory: pathlib.Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{directory}: no config.json; an HF checkpoint directory needs "
                              "config.json and *.safetensors")
    return config_from_hf_json(path)


def config_from_hf_json(path: pathlib.Path) -> ModelConfig:
    """A transformers config.json -> ModelConfig; every defect is a CheckpointError naming it."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    try:
        return ModelConfig.from_hf(data)
    except (ValueError, KeyError, TypeError, ArithmeticError, AttributeError) as e:
        # e.g. num_attention_heads 0 (a division) or a list where a mapping belongs
        raise CheckpointError(f"{path}: {type(e).__name__}: {e}") from e


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> file that holds it, from the shard index or the files themselves."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_index(index)
        missing = sorted({f for f in weight_map.values() if not (directory / f).exists()})
        if missing:
            raise CheckpointError(f"{index}: names shard files that do not exist: "
                                  f"{missing[:8]}")
        return {name: directory / f for name, f in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (PyTorch .bin files are not "
                              "loaded: convert them to safetensors)")
    found = {}
    for f in files:
        with _open(f) as sf:
            found.update({name: f for name in sf.keys()})
    return found


def _read_index(index: pathlib.Path) -> dict[str, str]:
    """The shard index's weight_map (tensor name -> file name in the same directory)."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: invalid JSON ({e})") from e
    weight_map = data.get("weight_map", {}) if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: must be an object whose 'weight_map' maps tensor "
                              "names to shard file names")
    # A shard is a file beside the index: a name with a directory part could make a
    # downloaded checkpoint read any file on the machine.
    outside = sorted({f for f in weight_map.values() if pathlib.PurePath(f).name != f})
    if outside:
        raise CheckpointError(f"{index}: shard names must be plain file names in the "
                              f"checkpoint directory, got {outside[:3]}")
    return weight_map


def _open(path: pathlib.Path):
    try:
        # "flax" because numpy has no bfloat16; arrays come back as jax arrays.
        return safe_open(str(path), framework="flax")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def read_hf_checkpoint(directory) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Returns the config and float32 HF-named tensors of a checkpoint directory."""
    directory = pathlib.Path(directory)
    config = read_hf_config(directory)
    where = _weight_files(directory)
    check_fits_files(config, len(layer_indices(where, "model.layers.")),
                     sum(f.stat().st_size for f in set(where.values())), str(directory))
    if "lm_head.weight" not in where and not config.tie_word_embeddings:
        # Some exports omit the flag while sharing the embedding; say so rather than guess.
        raise CheckpointError(f"{directory}: missing tensor 'lm_head.weight' and "
                              "tie_word_embeddings is false in config.json")
    handles, tensors = {}, {}
    try:
        for name in file_shapes(config):
            if name not in where:
                continue  # reported by check_tensors below, with the expected shape
            path = where[name]
            if path not in handles:
                handles[path] = _open(path).__enter__()
            try:
                tensors[name] = np.asarray(handles[path].get_tensor(name), dtype=np.float32)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    check_tensors(lambda n: tensors[n].shape if n in tensors else None, config, str(directory),
                  file_shapes(config))
    return config, unfuse(tensors, config)
