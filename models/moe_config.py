"""The mixture-of-experts fields of ModelConfig: checks, HF config parsing, parameter count.

Kept apart from models/config.py (which calls these through one-line hooks) and free of jax,
like it. A model is MoE when `num_experts > 0`; every decoder layer then has a MoE MLP
(models/moe.py) in place of the dense one.
"""

from __future__ import annotations

from typing import Any, Mapping

# HF model_type -> our architecture name for the MoE families we load.
MOE_MODEL_TYPES = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"}
MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                     "OlmoeForCausalLM": "olmoe"}


def moe_architecture(hf: Mapping[str, Any]) -> str | None:
    """Our architecture name when `hf` (a config.json dict) is a MoE family we load, else None."""
    found = MOE_MODEL_TYPES.get(hf.get("model_type"))
    for arch in hf.get("architectures") or []:
        found = found or MOE_ARCHITECTURES.get(arch)
    return found


def check_moe(config) -> None:
    """ModelConfig.__post_init__'s MoE checks (nothing to check for a dense model)."""
    e, k, f = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    for name, value in (("num_experts", e), ("num_experts_per_tok", k),
                        ("moe_intermediate_size", f)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"ModelConfig.{name} must be a non-negative integer, got {value!r}")
    if e == 0:
        if k or f:
            raise ValueError("num_experts_per_tok and moe_intermediate_size need num_experts > 0 "
                             "(0 experts is a dense model)")
        return
    if not 1 <= k <= e:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={e}], got {k}")
    if f <= 0:
        raise ValueError("a MoE model needs moe_intermediate_size > 0 (each expert's FFN width)")


def _refuse(model_type: str, why: str):
    raise ValueError(f"{model_type}: {why} is not supported by jaxserve's MoE layers")


def moe_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a MoE config.json ({} for a dense model).

    Refuses what the MoE path does not implement, naming the field: mixed dense/MoE layer
    stacks (Qwen3-MoE `decoder_sparse_step` != 1 or `mlp_only_layers`), shared experts and
    OLMoE's `clip_qkv`. Sets the family's q/k norm (OLMoE over the whole projection, Qwen3-MoE
    per head). The attention fields are models/hf_config.py's, as for the dense families.
    """
    arch = moe_architecture(hf)
    if arch is None:
        return {}
    mt = hf.get("model_type", arch)
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"{mt}: config.json lacks num_local_experts / num_experts")
    if arch == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            _refuse(mt, "a mix of dense and MoE layers (decoder_sparse_step="
                    f"{hf.get('decoder_sparse_step', 1)}, mlp_only_layers="
                    f"{hf.get('mlp_only_layers')})")
    if hf.get("shared_expert_intermediate_size"):
        _refuse(mt, "a shared expert (shared_expert_intermediate_size)")
    if arch == "olmoe" and hf.get("clip_qkv") is not None:
        _refuse(mt, f"clip_qkv={hf['clip_qkv']}")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(mt, f"hidden_act={hf['hidden_act']!r} (experts are SwiGLU)")
    return dict(
        architecture=arch,
        num_experts=int(experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        # Mixtral always renormalises the top-k (softmax over the chosen logits).
        norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        qk_norm={"mixtral": "none", "olmoe": "full", "qwen3_moe": "per_head"}[arch],
    )


def mlp_params(config) -> int:
    """Parameters of one layer's MLP: dense SwiGLU, or the router plus every expert."""
    d = config.hidden_size
    if not config.num_experts:
        return 3 * d * config.intermediate_size
    return d * config.num_experts + config.num_experts * 3 * d * config.moe_intermediate_size
