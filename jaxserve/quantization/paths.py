"""Inference paths: which weights a `quantization=` name serves, and how activations run.

    w8a16  int8 weights, symmetric per output channel; float activations
    w4a16  int4 weights, affine per group of 128 (or 64/32 where 128 does not divide K);
           the Pallas int4 kernel on GPU, the XLA reference on CPU. "int4" is an alias.
    w8a8   w8a16's weights x int8 activations quantized per token at run time
    w4a8   w4a16's weights x int8 activations quantized per token (the native CPU kernel's
           fast path; elsewhere its XLA reference)
    gguf   the GGUF file's own Q4_0/Q4_1 (int4, g=32) and Q8_0 (int8, g=32) blocks, as is

The LM head: w8a16, w8a8 and w4a8 quantize it int8 per channel (it is about a fifth of
SmolLM2's FLOPs and weight bytes, and batch-1 decode reads every byte of it per token); gguf uses
the file's own head (the Q8_0 token embedding, tied); w4a16 keeps it float, as most W4A16
deployments do. The embedding lookup always reads the float table. A mixture-of-experts model
takes w8a16 only (its experts per expert and channel: quantization/moe.py).
"""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.config import QUANTIZATION_ALIASES as ALIASES
from jaxserve.config import QUANTIZATION_MODES as MODES
from jaxserve.config import QUANTIZATION_PATHS as PATHS
from jaxserve.quantization.core import QuantSpec
from jaxserve.quantization.gguf_native import NATIVE_TYPES, gguf_native_params
from jaxserve.quantization.rtn import quantize_head, quantize_kernels
from jaxserve.quantization.moe import quantize_experts

log = logging.getLogger("jaxserve")

INT8_CHANNEL = QuantSpec(bits=8, granularity="channel", symmetric=True)
INT4_G128 = QuantSpec(bits=4, granularity="group", group_size=128)


def canonical(path: str | None) -> str | None:
    """A path name (aliases resolved), "auto", or None for float weights ("none")."""
    path = ALIASES.get(path, path)
    if path == "none":
        return None
    if path is not None and path not in MODES and path not in PATHS:
        raise ValueError(f"quantization must be one of {(*MODES, *PATHS)}, got {path!r}")
    return path


def has_native_blocks(model) -> bool:
    """Whether `model` carries GGUF blocks that quantization='gguf' serves natively."""
    return any(t.qtype in NATIVE_TYPES for t in getattr(model, "raw", {}).values())


def auto_path(model, tensor_parallel_size: int = 1) -> tuple[str | None, str]:
    """What quantization="auto" serves for `model`, and why (the start-up line's words)."""
    saved = getattr(model, "quantization", None)
    if saved is not None:
        return saved, f"the checkpoint's own {saved} weights"
    if not has_native_blocks(model):
        return None, f"{model.dtype} as loaded"
    kinds = "/".join(sorted({t.qtype.name for t in model.raw.values()
                             if t.qtype in NATIVE_TYPES}))
    if model.config.num_experts:
        return None, (f"float weights: the file's {kinds} blocks are dequantized, as a "
                      "mixture-of-experts model has no gguf path")
    if tensor_parallel_size > 1:
        return None, (f"float weights: the file's {kinds} blocks are dequantized, as the gguf "
                      "path runs on one device")
    return "gguf", f"the file's own {kinds} blocks (quantization='none' serves float weights)"


def activation_bits(path: str | None) -> int:
    return 8 if canonical(path) in ("w8a8", "w4a8") else 16


def quantize_params(model, path: str) -> dict:
    """The float model's params prepared for `path` (round-to-nearest, or the GGUF blocks)."""
    path = canonical(path)
    if path == "gguf":
        if not model.raw:
            raise ValueError("quantization='gguf' serves a .gguf file's own quantized blocks; "
                             f"{model.source} has none (load a .gguf model, or pick one of "
                             f"{[p for p in PATHS if p != 'gguf']})")
        return gguf_native_params(model.params, model.raw, model.config)
    if path == "w4a16":
        return quantize_kernels(model.params, INT4_G128)
    if path == "w4a8":
        return quantize_head(quantize_kernels(model.params, INT4_G128), INT8_CHANNEL)
    params = quantize_kernels(model.params, INT8_CHANNEL)
    if model.config.num_experts:
        params = quantize_experts(params, INT8_CHANNEL)
    return quantize_head(params, INT8_CHANNEL)


def refuse_moe(config, what: str) -> None:
    """A MoE model's experts are stacked arrays run by ragged_dot (models/moe.py); of the
    quantized paths only w8a16 serves them (quantization/moe.py)."""
    if config.num_experts:
        raise ValueError(
            f"{what} is not supported for mixture-of-experts models ({config.architecture}, "
            f"{config.num_experts} experts): use quantization='w8a16', or serve them "
            "unquantized (dtype='bfloat16' halves the weights)")


def prepare_model(model, requested: str | None, *, tensor_parallel_size: int = 1):
    """(model with params for the path, the path served). requested: a path, "auto" (see
    auto_path), or "none"/None for the weights as loaded, in float.

    A model that is already quantized (an orbax checkpoint from `jaxserve quantize`) is served
    on the path it was saved for; asking for another is an error, not a silent re-quantization.
    """
    explicit_float = requested == "none"
    requested = canonical(requested)
    if requested == "auto":
        requested, why = auto_path(model, tensor_parallel_size)
        log.info("weights: %s", why)
    saved = getattr(model, "quantization", None)
    if saved is not None:
        if requested != saved and (requested is not None or explicit_float):
            raise ValueError(f"{model.source} holds {saved} weights; it cannot be served as "
                             f"{requested or 'float'} (use quantization='auto' or {saved!r}, "
                             "or quantize the float model)")
        return model, saved
    if requested is None:
        return model, None
    if requested != "w8a16":
        refuse_moe(model.config, f"quantization={requested!r}")
    params = quantize_params(model, requested)
    return dataclasses.replace(model, params=params, quantization=requested, raw={}), requested
