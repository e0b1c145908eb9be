"""Model configuration: one frozen dataclass for every Llama-family checkpoint we load."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping, get_args

from models import windowed

# Weight and activation dtypes; declared here, where models/ reads them, and imported by jaxserve.
Dtype = Literal["float32", "bfloat16"]
DTYPES = get_args(Dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= 0:
            raise ValueError(f"rope scaling factors must be positive, got {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope scaling original_max_position_embeddings must be positive")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, SmolLM2, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # Sliding-window / soft-capped families (models/windowed.py): Mistral, Gemma 2, Gemma 3.
    sliding_window: int | None = None  # keys older than this many positions are not seen
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention"
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers
    hidden_act: str = "silu"  # Gemma: "gelu_pytorch_tanh" (GeGLU)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.architecture not in ("llama", "qwen2", *windowed.HF_ARCHS):
            raise ValueError(f"unsupported architecture {self.architecture!r}: use llama, "
                             f"qwen2 or one of {tuple(windowed.HF_ARCHS)}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be silu or gelu_pytorch_tanh, got "
                             f"{self.hidden_act!r}")
        windowed.check(self)

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        # K and V for every layer; with GQA only the KV heads are stored.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        if self.attention_bias:
            per_layer += q + 2 * kv
        out = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a transformers ``config.json`` dict."""
        if windowed.windowed_arch(hf):
            return windowed.from_hf(cls, hf, windowed.windowed_arch(hf))
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "qwen2") and not any(
                a in ("LlamaForCausalLM", "Qwen2ForCausalLM") for a in archs):
            raise ValueError(
                f"unsupported model_type {model_type!r} (architectures {archs}): jaxserve loads "
                "LlamaForCausalLM and Qwen2ForCausalLM checkpoints")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required fields {missing}")
        num_heads = hf["num_attention_heads"]
        # transformers >= 5 keeps theta and scaling in `rope_parameters`; older files in
        # `rope_theta` / `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type")
        scaling = None
        if rope_type == "llama3":
            src = rope if "factor" in rope else legacy
            scaling = RopeScaling(
                factor=float(src["factor"]), low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]))
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope type {rope_type!r}: jaxserve supports default "
                             "and llama3 RoPE")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen = model_type == "qwen2" or "Qwen2ForCausalLM" in archs
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if is_qwen else 1e-5)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)) or is_qwen,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture="qwen2" if is_qwen else "llama",
        )


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype
