"""Parses a transformers ``config.json`` dict into ModelConfig fields, one function per family.

Every family shares the Llama fields (`_common`); each parser adds or refuses what its
architecture changes, so a checkpoint with a feature jaxserve does not implement is refused
with the field's name rather than served wrong.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from models.config import ROPE_TYPES, RopeScaling
from models.moe_config import MOE_ARCHITECTURES, MOE_MODEL_TYPES, moe_fields_from_hf

log = logging.getLogger("jaxserve")

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def _rope_parameters(hf: Mapping[str, Any]) -> dict:
    """transformers >= 5 keeps theta and scaling in `rope_parameters`; older files in
    `rope_theta` / `rope_scaling` (and Phi-3 its original length at the top level)."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    if "original_max_position_embeddings" in hf:
        rope.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    return rope


def rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    """The RopeScaling of a config.json, None for plain RoPE; an unknown type is refused."""
    rope = _rope_parameters(hf)
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {kind!r}: jaxserve supports default, "
                         f"{', '.join(ROPE_TYPES)}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor "
                         f"{rope['partial_rotary_factor']}) are not supported")
    fields = {k: rope[k] for k in ("low_freq_factor", "high_freq_factor", "beta_fast",
                                   "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                   "truncate") if rope.get(k) is not None}
    orig = rope.get("original_max_position_embeddings")
    factor = rope.get("factor")
    if factor is None and kind in ("yarn", "longrope") and orig:
        # transformers' default: the context extension the checkpoint was made for.
        factor = hf.get("max_position_embeddings", orig) / orig
    return RopeScaling(
        rope_type=kind, factor=float(1.0 if factor is None else factor),
        original_max_position_embeddings=None if orig is None else int(orig),
        short_factor=tuple(float(x) for x in rope.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in rope.get("long_factor") or ()), **fields)


def _eos_ids(hf) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _common(hf: Mapping[str, Any], eps_default: float = 1e-5) -> dict:
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks required fields {missing}")
    num_heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", eps_default)),
        rope_theta=float(_rope_parameters(hf)["rope_theta"]), rope_scaling=rope_scaling(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=_eos_ids(hf))


def _refuse_sliding_window(hf: Mapping[str, Any], fields: dict, on_by_default: bool) -> dict:
    """Caps the context at a sliding window so that the window never cuts (no window support
    in this path): exact for every sequence that fits."""
    window = hf.get("sliding_window")
    used = hf.get("use_sliding_window", on_by_default)
    if used and window and window < fields["max_position_embeddings"]:
        log.warning("sliding_window %d: serving contexts up to %d tokens, where the window "
                    "never cuts", window, window)
        fields["max_position_embeddings"] = int(window)
    return fields


def _no_o_proj_bias(fields: dict, family: str) -> dict:
    # Llama and Qwen3 put a bias on o_proj too when attention_bias is set (Qwen2 does not).
    if fields["attention_bias"]:
        raise ValueError(f"{family} with attention_bias=true (biases on q/k/v and o_proj) is "
                         "not supported")
    return fields


def _llama(hf) -> dict:
    return _no_o_proj_bias(dict(_common(hf), architecture="llama"), "llama")


def _qwen2(hf) -> dict:
    fields = _common(hf, eps_default=1e-6)
    fields = dict(fields, attention_bias=True, architecture="qwen2")
    return _refuse_sliding_window(hf, fields, False)


def _qwen3(hf) -> dict:
    # Qwen3: q/k RMSNorm per head before RoPE, no q/k/v biases.
    fields = dict(_common(hf, eps_default=1e-6), qk_norm="per_head", architecture="qwen3")
    _no_o_proj_bias(fields, "qwen3")
    return _refuse_sliding_window(hf, fields, False)


def _phi3(hf) -> dict:
    fields = dict(_common(hf), architecture="phi3")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"phi3 hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    s = fields["rope_scaling"]
    if s is not None and s.rope_type == "longrope" and \
            fields["max_position_embeddings"] > s.original_max_position_embeddings:
        log.warning("longrope: serving contexts up to original_max_position_embeddings=%d "
                    "(short_factor), not %d", s.original_max_position_embeddings,
                    fields["max_position_embeddings"])
        fields["max_position_embeddings"] = s.original_max_position_embeddings
    return _refuse_sliding_window(hf, fields, True)


def _moe(hf) -> dict:
    # Mixtral, Qwen3-MoE, OLMoE: Llama attention (OLMoE/Qwen3-MoE with q/k norms) and MoE MLPs.
    fields = dict(_common(hf, eps_default=1e-6), **moe_fields_from_hf(hf))
    return _refuse_sliding_window(hf, fields, fields["architecture"] == "mixtral")


# model_type -> parser; `architectures` names map onto the same keys.
PARSERS: dict[str, Callable[[Mapping[str, Any]], dict]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3}
_ARCHITECTURE_NAMES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}
PARSERS.update({model_type: _moe for model_type in MOE_MODEL_TYPES})  # models/moe_config.py
_ARCHITECTURE_NAMES.update(MOE_ARCHITECTURES)


def config_fields(hf: Mapping[str, Any]) -> dict:
    """ModelConfig keyword arguments for a config.json dict; unsupported families refused."""
    archs = hf.get("architectures") or []
    named = [_ARCHITECTURE_NAMES[a] for a in archs if a in _ARCHITECTURE_NAMES]
    model_type = hf.get("model_type") or (named[0] if named else "llama")
    if model_type not in PARSERS and named:
        model_type = named[0]
    if model_type not in PARSERS:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures {archs}): jaxserve loads "
            f"{', '.join(sorted(_ARCHITECTURE_NAMES))} checkpoints")
    return PARSERS[model_type](hf)
