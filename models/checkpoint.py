"""Orbax save/restore of converted params: the fast start path (no GGUF dequantization).

Quantized kernels (models/quantized.py) are saved by orbax as the dicts of their array fields
and rebuilt into Int4Weight/Int8Weight on restore (`quantized.from_stored`).
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from models import quantized
from models.config import ModelConfig
from models.weights import CheckpointError

CONFIG_FILE = "jaxserve_config.json"
PARAMS_DIR = "params"


# Quantized kernels keep their codes' integer dtypes and float32 scales/offsets whatever the
# model dtype.
QUANT_PARAM_KEYS = quantized.FLOAT32_FIELDS


def is_orbax_dir(path: pathlib.Path) -> bool:
    return (path / CONFIG_FILE).exists()


def leaf_dtype(path, x, dtype):
    """The dtype a param leaf is held in for a model of `dtype`."""
    if np.issubdtype(np.dtype(x.dtype), np.integer):
        return x.dtype
    keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}  # dict key / field
    return np.float32 if keys & set(QUANT_PARAM_KEYS) else dtype


def save(model, directory) -> pathlib.Path:
    """Writes params (orbax), the model config and the tokenizer files into `directory`."""
    import orbax.checkpoint as ocp
    directory = pathlib.Path(directory).absolute()
    if (directory / PARAMS_DIR).exists():
        raise FileExistsError(f"{directory / PARAMS_DIR} exists; choose a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / PARAMS_DIR, model.params)
        ckptr.wait_until_finished()
    meta = {"config": model.config.to_dict(), "dtype": model.dtype, "source": model.source,
            "quantization": getattr(model, "quantization", None)}
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save(directory)
    return directory


def _local_target(ckptr, directory):
    """The stored arrays' shapes and dtypes on this process's first device. Restoring as saved
    asks for the device that saved them (e.g. cpu:0), which the other processes of a multi-host
    run do not have: orbax refuses ("Topology mismatch")."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    stored = ckptr.metadata(directory / PARAMS_DIR).item_metadata.tree
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        stored)


def restore(directory, dtype):
    """Returns (config, params as numpy in `dtype`, tokenizer or None, quantization path)."""
    import orbax.checkpoint as ocp
    from models.tokenizer import Tokenizer
    directory = pathlib.Path(directory).absolute()
    try:
        meta = json.loads((directory / CONFIG_FILE).read_text())
        config = ModelConfig.from_dict(meta["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: unreadable jaxserve config ({e})") from e
    if not (directory / PARAMS_DIR).exists():
        raise CheckpointError(f"{directory}: no {PARAMS_DIR}/ orbax checkpoint next to "
                              f"{CONFIG_FILE}")
    with ocp.StandardCheckpointer() as ckptr:
        params = quantized.from_stored(ckptr.restore(directory / PARAMS_DIR,
                                                     _local_target(ckptr, directory)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: np.asarray(x).astype(leaf_dtype(path, x, dtype)), params)
    tokenizer = (Tokenizer.from_hf_dir(directory)
                 if (directory / "tokenizer.json").exists() else None)
    return config, params, tokenizer, meta.get("quantization")
