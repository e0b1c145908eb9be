"""Model configuration: one frozen dataclass for every Llama-family checkpoint we load."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping, get_args

from models.moe_config import MOE_MODEL_TYPES, check_moe, mlp_params  # the MoE fields
from models import windowed

# Weight and activation dtypes; declared here, where models/ reads them, and imported by jaxserve.
Dtype = Literal["float32", "bfloat16"]
DTYPES = get_args(Dtype)


# RoPE frequency scalings, as transformers names them (`rope_type`); models/rope.py computes each.
RopeType = Literal["linear", "dynamic", "yarn", "llama3", "longrope"]
ROPE_TYPES = get_args(RopeType)
# Per-head q/k RMSNorm before RoPE: "per_head" normalises each head over head_dim (Qwen3,
# Gemma 3), "full" the whole q `[H * Dh]` and k `[K * Dh]` projections (OLMoE).
QkNorm = Literal["none", "per_head", "full"]
QK_NORMS = get_args(QkNorm)
# Decoder families this config describes (models/hf_config.py parses each from config.json).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", *MOE_MODEL_TYPES.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling; which fields apply depends on `rope_type` (see models/rope.py).

    llama3: factor, low/high_freq_factor, original_max_position_embeddings. linear, dynamic:
    factor. yarn: factor, original_max_position_embeddings, beta_fast/slow, mscale(_all_dim),
    attention_factor, truncate. longrope: short/long_factor (one per frequency),
    original_max_position_embeddings, factor, attention_factor.
    """

    rope_type: RopeType = "llama3"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}: jaxserve supports "
                             f"default, {', '.join(ROPE_TYPES)}")
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        needs_orig = self.rope_type in ("llama3", "yarn", "longrope")
        if needs_orig and not (self.original_max_position_embeddings or 0) > 0:
            raise ValueError(f"{self.rope_type} rope scaling needs a positive "
                             "original_max_position_embeddings")
        if self.rope_type == "llama3":
            self._check_llama3()
        if self.rope_type == "longrope" and (
                not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("longrope scaling needs short_factor and long_factor of equal "
                             "length (one per rotary frequency, head_dim / 2)")

    def _check_llama3(self):
        lo, hi = self.low_freq_factor, self.high_freq_factor
        if lo is None or hi is None or lo <= 0 or hi <= 0:
            raise ValueError(f"llama3 rope scaling needs positive low_freq_factor and "
                             f"high_freq_factor, got {self}")
        if hi <= lo:
            raise ValueError("rope scaling needs high_freq_factor > low_freq_factor, got "
                             f"{hi} <= {lo}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, SmolLM2, Qwen2/3, Phi-3)."""

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
    qk_norm: QkNorm = "none"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # Mixture of experts (models/moe_config.py checks and parses them); 0 experts: dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
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
        if self.architecture not in (*ARCHITECTURES, *windowed.HF_ARCHS):
            raise ValueError(f"unsupported architecture {self.architecture!r}: use one of "
                             f"{(*ARCHITECTURES, *windowed.HF_ARCHS)}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be silu or gelu_pytorch_tanh, got "
                             f"{self.hidden_act!r}")
        windowed.check(self)
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope" and \
                len(self.rope_scaling.short_factor) != self.head_dim // 2:
            raise ValueError(f"longrope short/long_factor have {len(self.rope_scaling.short_factor)}"
                             f" values; head_dim {self.head_dim} needs {self.head_dim // 2}")
        self._check_context()
        check_moe(self)

    def _check_context(self):
        s = self.rope_scaling
        # transformers switches longrope/dynamic frequencies by the whole sequence's length,
        # which a KV cache cannot follow once keys are stored: served contexts stay where one
        # frequency set is exactly transformers' for every sequence (models/rope.py).
        if s is not None and s.rope_type == "longrope" and \
                self.max_position_embeddings > s.original_max_position_embeddings:
            raise ValueError(
                f"longrope RoPE: max_position_embeddings {self.max_position_embeddings} exceeds "
                f"original_max_position_embeddings {s.original_max_position_embeddings}; "
                "contexts past it (long_factor) are not supported yet")

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        # K and V for every layer; with GQA only the KV heads are stored. scale_bytes: per
        # (token, KV head) of K or V (an int8 cache's scales).
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes
                                                          + scale_bytes)

    def num_params(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + mlp_params(self) + 2 * d  # MLP: dense or experts
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.architecture in windowed.GEMMA:  # the sandwich norms
            per_layer += 2 * d
        per_layer += {"none": 0, "per_head": 2 * self.head_dim, "full": q + kv}[self.qk_norm]
        out = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            rope = dict(data["rope_scaling"])
            for key in ("short_factor", "long_factor"):
                rope[key] = tuple(rope.get(key, ()))
            data["rope_scaling"] = RopeScaling(**rope)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a transformers ``config.json`` dict (models/hf_config.py)."""
        if windowed.windowed_arch(hf):  # Mistral, Gemma 2, Gemma 3 (models/windowed.py)
            return windowed.from_hf(cls, hf, windowed.windowed_arch(hf))
        from models.hf_config import config_fields
        return cls(**config_fields(hf))


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype
