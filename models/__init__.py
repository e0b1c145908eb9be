"""Flax Llama-family models and their loaders (GGUF, HF safetensors, orbax).

Exports are lazy (PEP 562) so that host-only users of a submodule (jaxserve.core reads
`models.tokenizer`) do not import jax through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"Model": "models.model", "load_model": "models.model", "ModelConfig": "models.config"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from models.config import ModelConfig
    from models.model import Model, load_model


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
