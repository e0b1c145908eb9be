"""`load_model`: one entry point for named models, .gguf files, HF directories and orbax saves."""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import checkpoint, registry
from models.config import ModelConfig, check_dtype
from models.llama import Llama
from models.tokenizer import Tokenizer
from models.weights import params_from_hf

log = logging.getLogger("jaxserve")

MIN_BUCKET = 16


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum): bounds the number of compiled shapes."""
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {n}")
    return max(minimum, 1 << (n - 1).bit_length())


def enable_compilation_cache(directory: str | pathlib.Path | None = None) -> None:
    """Turns on JAX's persistent compilation cache so a second start reuses compiled programs."""
    directory = directory or registry.cache_dir() / "xla_cache"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded model: config, device params, tokenizer, and a dense (no KV cache) forward."""

    config: ModelConfig
    params: Any  # Flax params tree of device arrays
    tokenizer: Tokenizer | None
    dtype: str
    source: str
    raw: dict = dataclasses.field(default_factory=dict)  # GGUF quantized blocks, if any
    # The inference path the params are prepared for (jaxserve/quantization/paths.py), if any.
    quantization: str | None = None

    def module(self, **kwargs) -> Llama:
        return Llama(self.config, dtype=jnp.dtype(self.dtype), **kwargs)

    @functools.cached_property
    def _dense_forward(self):
        module = self.module()

        @jax.jit
        def forward(params, tokens):  # tokens [1, T]
            positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]  # [1, T]
            logits, _ = module.apply({"params": params}, tokens, positions)
            return logits[0]  # [T, V]
        return forward

    def forward_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Float32 logits `[len(ids), vocab]` of a dense causal forward over `ids`."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("forward_logits takes a non-empty 1-D list of token ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        # Padding at the end cannot change earlier positions under the causal mask.
        padded = np.zeros((1, bucket_length(ids.size)), np.int32)
        padded[0, :ids.size] = ids
        return np.asarray(self._dense_forward(self.params, padded))[:ids.size]

    def greedy_generate(self, ids: Sequence[int], max_new_tokens: int,
                        stop_token_ids: Sequence[int] | None = None) -> list[int]:
        """Greedy decoding by full recompute: slow, but the oracle the paged engine must match."""
        stop = set(self.tokenizer.stop_token_ids if stop_token_ids is None and self.tokenizer
                   else stop_token_ids or ())
        ids, out = list(ids), []
        for _ in range(max_new_tokens):
            nxt = int(np.argmax(self.forward_logits(ids + out)[-1]))
            out.append(nxt)
            if nxt in stop:
                break
        return out


def _to_device(params_np, dtype: str):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(x, dtype=checkpoint.leaf_dtype(path, x, dtype)), params_np)


def load_model(name_or_path: str | pathlib.Path = registry.DEFAULT_MODEL, dtype: str = "float32",
               *, compilation_cache: bool = True, weights_cache: bool = True) -> Model:
    """Loads a named model (e.g. "smollm2-135m"), a .gguf file, an HF dir or an orbax save.

    weights_cache: keep a GGUF file's converted weights under the cache directory
    (models/weights_cache.py) and read them from there on the next start.
    """
    check_dtype(dtype)
    if compilation_cache:
        enable_compilation_cache()
    start = time.perf_counter()
    spec = str(name_or_path)
    path = registry.model_path(spec) if spec in registry.MODELS else pathlib.Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"{spec!r} is neither a known model name "
                                f"({sorted(registry.MODELS)}) nor an existing path")
    raw: dict = {}
    quantization = None
    np_dtype = jnp.dtype(dtype)
    if path.is_file():
        from models.weights_cache import load_gguf
        c = load_gguf(path, np_dtype, registry.cache_dir() if weights_cache else None)
        config, params, tokenizer, raw = c.config, c.params, c.tokenizer, c.raw
    elif checkpoint.is_orbax_dir(path):
        config, params, tokenizer, quantization = checkpoint.restore(path, np_dtype)
    else:
        from models.hf_loader import read_hf_checkpoint
        config, tensors = read_hf_checkpoint(path)
        params = params_from_hf(tensors, config, np_dtype, source=str(path))
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    model = Model(config=config, params=_to_device(params, dtype), tokenizer=tokenizer,
                  dtype=dtype, source=str(path), raw=raw, quantization=quantization)
    log.info("loaded %s (%s, %.1fM params) in %.2fs", path, dtype, config.num_params() / 1e6,
             time.perf_counter() - start)
    return model
