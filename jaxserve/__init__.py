"""jaxserve: an LLM inference and serving engine on JAX/XLA.

The public API is chosen here and imported lazily (PEP 562): `import jaxserve.core.scheduler`
must not start jax, and `from jaxserve import LLM` should pay for jax only when asked.

Layers and who may import whom: docs/architecture.md (written there once).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "LLMEngine": "jaxserve.engine",
    "EngineConfig": "jaxserve.config",
    "SamplingParams": "jaxserve.core.sampling_params",
    "RequestOutputKind": "jaxserve.core.sampling_params",
    "RequestOutput": "jaxserve.core.outputs",
    "CompletionOutput": "jaxserve.core.outputs",
    "LoRARequest": "jaxserve.core.lora",
    "PoolingParams": "jaxserve.core.pooling",
    "EmbeddingRequestOutput": "jaxserve.core.pooling",
    "EmbeddingOutput": "jaxserve.core.pooling",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.core.lora import LoRARequest
    from jaxserve.core.outputs import CompletionOutput, RequestOutput
    from jaxserve.core.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
    from jaxserve.core.sampling_params import RequestOutputKind, SamplingParams
    from jaxserve.engine import LLMEngine
    from jaxserve.llm import LLM


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
