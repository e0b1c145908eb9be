"""Randomly initialised models: tiny ones for fast tests, full-size shapes for benchmarks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.llama import Llama
from models.model import Model


def random_model(config: ModelConfig, dtype: str = "float32", seed: int = 0) -> Model:
    """A Model with Flax's default initialisers (on device; no tokenizer)."""
    module = Llama(config, dtype=jnp.dtype(dtype))
    tokens = jnp.zeros((1, 1), jnp.int32)  # [B, T]
    init = jax.jit(lambda key: module.init(key, tokens, tokens)["params"])
    params = init(jax.random.key(seed))
    return Model(config=config, params=params, tokenizer=None, dtype=dtype,
                 source=f"random(seed={seed})")
