"""Sliding-window and soft-capped families (Mistral, Gemma 2, Gemma 3 text): config parsing and
the per-layer attention settings the model hands to the attention backend.

A layer's window W means a query at position p sees keys at positions (p - W, p]: transformers'
`kv_idx > q_idx - sliding_window`. Global layers carry NO_WINDOW, so one int32 array indexed by
the (traced) layer index serves every layer of the scan without a recompile per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

# Larger than any context: a "window" that never cuts. Stays far from int32 overflow in p - W.
NO_WINDOW = 1 << 30

HF_ARCHS = {"mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
LAYER_TYPES = ("sliding_attention", "full_attention")


def windowed_arch(hf: Mapping[str, Any]) -> str | None:
    """The family of a transformers config.json dict, if it is one of these."""
    model_type = hf.get("model_type")
    if model_type in HF_ARCHS:
        return model_type
    archs = hf.get("architectures") or []
    return next((m for m, a in HF_ARCHS.items() if a in archs), None)


def _default_layer_types(arch: str, hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    if arch == "mistral":  # every layer slides (when a window is set)
        return ("sliding_attention",) * num_layers
    # Gemma 2 alternates (local first); Gemma 3 has 5 local : 1 global by default.
    pattern = 2 if arch == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(num_layers))


def _gemma3_rope(hf: dict) -> tuple[dict, float]:
    """(config with the global layers' RoPE as the base parser reads it, local RoPE theta).
    transformers >= 5 nests RoPE per layer type; older files use rope_local_base_freq."""
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        local = (rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope type {local['rope_type']!r} on Gemma 3's local "
                             "layers: jaxserve supports default RoPE there")
        hf = dict(hf, rope_parameters=dict(rope["full_attention"]))
        hf["rope_parameters"].setdefault("rope_theta", 1_000_000.0)
        return hf, float(local.get("rope_theta", 10_000.0))
    hf = dict(hf)
    hf.setdefault("rope_theta", 1_000_000.0)
    return hf, float(hf.get("rope_local_base_freq", 10_000.0))


def from_hf(cls, hf: Mapping[str, Any], arch: str):
    """ModelConfig of a Mistral / Gemma 2 / Gemma 3 text config.json (cls: ModelConfig)."""
    hf = dict(hf)
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention (an encoder) is not "
                         "supported: jaxserve serves causal decoders")
    local_theta = None
    if arch == "gemma3_text":
        hf, local_theta = _gemma3_rope(hf)
    if arch in GEMMA:
        hf.setdefault("rms_norm_eps", 1e-6)
        hf.setdefault("tie_word_embeddings", True)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma hidden_activation {act!r}: jaxserve runs "
                             "gelu_pytorch_tanh")
    base = cls.from_hf(dict(hf, model_type="llama", architectures=[], attention_bias=False))
    window = hf.get("sliding_window", None if arch == "mistral" else 4096)
    types = tuple(hf.get("layer_types") or _default_layer_types(arch, hf, base.num_layers))
    extra: dict[str, Any] = dict(architecture=arch, sliding_window=window,
                                 layer_types=types if window is not None else ())
    if arch in GEMMA:
        softcap = ((50.0, 30.0) if arch == "gemma2" else (None, None))
        extra.update(
            hidden_act="gelu_pytorch_tanh",
            attn_logit_softcapping=hf.get("attn_logit_softcapping", softcap[0]),
            final_logit_softcapping=hf.get("final_logit_softcapping", softcap[1]),
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            rope_local_theta=local_theta)
    if arch == "gemma3_text":  # per-head q/k norms, Gemma's (1 + w) kind (models/llama.py)
        extra["qk_norm"] = "per_head"
    return dataclasses.replace(base, **extra)


def check(config) -> None:
    """Validates the window / soft-cap fields of a ModelConfig, with messages to act on."""
    c = config
    if c.sliding_window is not None and (not isinstance(c.sliding_window, int)
                                         or c.sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive integer or None, got "
                         f"{c.sliding_window!r}")
    if c.layer_types:
        if len(c.layer_types) != c.num_layers:
            raise ValueError(f"layer_types has {len(c.layer_types)} entries for "
                             f"{c.num_layers} layers")
        bad = sorted(set(c.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types may hold only {LAYER_TYPES}, got {bad}")
        if c.sliding_window is None:
            raise ValueError("layer_types names sliding layers but sliding_window is None")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                 "rope_local_theta"):
        value = getattr(c, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"ModelConfig.{name} must be positive (or None), got {value!r}")


def layer_windows(config) -> np.ndarray | None:
    """int32 `[L]`: each layer's window (NO_WINDOW on global layers); None when no layer has
    one, so models without windows trace exactly as before."""
    c = config
    if c.sliding_window is None:
        return None
    types = c.layer_types or ("sliding_attention",) * c.num_layers
    return np.asarray([c.sliding_window if t == "sliding_attention" else NO_WINDOW
                       for t in types], np.int32)


def model_window(config) -> int | None:
    """The window every layer slides (the largest), or None when some layer is global."""
    windows = layer_windows(config)
    if windows is None or (windows == NO_WINDOW).any():
        return None
    return int(windows.max())
