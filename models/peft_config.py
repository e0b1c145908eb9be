"""A PEFT LoRA adapter's adapter_config.json: which modules it adapts, with which rank and alpha.

Targets, exclusions, layer selection and rank/alpha patterns follow PEFT's own rules
(peft/tuners/tuners_utils.py `check_target_module_exists`, peft/utils/other.py
`get_pattern_key`), so a module is adapted here exactly when PEFT adapted it. Options that
change the forward pass beyond `x @ A^T @ B^T * scaling` are refused, each with its reason.
Plain Python: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any, Mapping

from models.lora_names import LoRAError

# PEFT's shorthand for every linear layer but the output head.
ALL_LINEAR = "all-linear"

# Initialisations that rewrite the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA): the
# adapter then only holds for that rewritten base unless PEFT converted it at save time
# (`path_initial_model_for_weight_conversion`, which stores init_lora_weights=True).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# Options whose non-empty value makes an adapter more than plain LoRA on linear layers.
_REFUSED = {
    "use_dora": "DoRA (use_dora) rescales each merged weight by a learned magnitude",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "modules_to_save": "modules_to_save replaces whole modules (heads and embeddings are not "
                       "adapted)",
    "trainable_token_indices": "trainable_token_indices trains embedding rows (heads and "
                               "embeddings are not adapted)",
    "target_parameters": "target_parameters adapts raw parameters such as MoE experts",
    "layer_replication": "layer_replication duplicates decoder layers",
    "use_qalora": "QA-LoRA (use_qalora) pools the input before lora_A",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) switches on mid-sequence",
    "use_bdlora": "BD-LoRA (use_bdlora) uses block-diagonal factors",
    "arrow_config": "Arrow routes tokens among several adapters",
    "kasa_config": "KaSA rewrites the base weights and adds a diagonal between A and B",
    "velora_config": "VeLoRA is a LoRA variant",
    "monteclora_config": "MonteCLoRA is a LoRA variant",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeftLoraConfig:
    """What adapter_config.json says about the adapted modules (PEFT's field names).

    Module keys below are full module names of the transformers model, e.g.
    "model.layers.3.self_attn.q_proj"."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()  # names / full names, or one regex (fullmatch)
    exclude_modules: tuple[str, ...] | str = ()
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def targets(self, key: str) -> bool:
        """Whether PEFT put a LoRA layer on the module `key`."""
        if _matches(self.exclude_modules, key):
            return False
        if isinstance(self.target_modules, str):
            # A regex names layers itself: PEFT ignores layers_to_transform for it.
            return re.fullmatch(self.target_modules, key) is not None
        if key in self.target_modules:
            return True
        if not any(key.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        return _layer_index(key, self.layers_pattern) in self.layers_to_transform

    def rank_alpha(self, key: str) -> tuple[int, float]:
        """The module's rank and alpha: the first matching pattern's, else r and lora_alpha."""
        r = _pattern_value(self.rank_pattern, key, self.r)
        return r, _pattern_value(self.alpha_pattern, key, self.lora_alpha)

    def scaling(self, key: str | None = None) -> float:
        """`lora_alpha / r` (rsLoRA: `/ sqrt(r)`) of module `key`, or the config's default."""
        r, alpha = (self.r, self.lora_alpha) if key is None else self.rank_alpha(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])


def _matches(names: tuple[str, ...] | str, key: str) -> bool:
    """PEFT's module matching: a regex fullmatch, or a name equal to or ending the key."""
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return key in names or any(key.endswith(f".{n}") for n in names)


def _layer_index(key: str, layers_pattern: tuple[str, ...]) -> int | None:
    """The layer number in `key`, as PEFT finds it: the first numbered segment (lazy, so an
    expert index later in the key is not taken), after `layers_pattern` when one is given."""
    patterns = layers_pattern or (None,)
    for pattern in patterns:
        regex = r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else \
            rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
        match = re.match(regex, key)
        if match:
            return int(match.group("idx"))
    return None


def _pattern_value(patterns: Mapping[str, Any], key: str, default):
    for pattern in patterns:  # dict order: the first match wins, as in PEFT
        if re.match(rf"(.*\.)?({pattern})$", key):
            return patterns[pattern]
    return default


def read_peft_config(path: pathlib.Path, all_linear: tuple[str, ...]) -> PeftLoraConfig:
    """Reads and checks adapter_config.json; every problem is a LoRAError naming the file.

    all_linear: the module names PEFT's "all-linear" stands for in this model."""
    if not path.is_file():
        raise LoRAError(f"{path.parent}: no adapter_config.json; a LoRA adapter directory holds "
                        "adapter_config.json and adapter_model.safetensors (PEFT's "
                        "save_pretrained)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise LoRAError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    try:
        return _parse(data, all_linear)
    except LoRAError as e:
        raise LoRAError(f"{path}: {e}") from None


def _parse(data: dict, all_linear: tuple[str, ...]) -> PeftLoraConfig:
    if data.get("peft_type") != "LORA":
        raise LoRAError(f"peft_type is {data.get('peft_type')!r}; only LoRA adapters "
                        "(peft_type 'LORA') are served")
    for field, reason in _REFUSED.items():
        if data.get(field):
            raise LoRAError(f"{field}={data[field]!r} is not supported: {reason}")
    if data.get("bias", "none") != "none":
        raise LoRAError(f"bias={data['bias']!r} is not supported: it trains the base model's "
                        "biases, which the adapter then carries; only bias 'none' is served")
    init = data.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoRAError(f"init_lora_weights={init!r} rewrote the base weights during training, "
                        "so the adapter does not apply to the original model; convert it with "
                        "PEFT's save_pretrained(path_initial_model_for_weight_conversion=...)")
    r = _positive_int(data.get("r"), "r")
    rank_pattern = {k: _positive_int(v, f"rank_pattern[{k!r}]")
                    for k, v in _mapping(data, "rank_pattern").items()}
    alpha_pattern = {k: _finite(v, f"alpha_pattern[{k!r}]")
                     for k, v in _mapping(data, "alpha_pattern").items()}
    return PeftLoraConfig(
        r=r, lora_alpha=_finite(data.get("lora_alpha", 8), "lora_alpha"),
        use_rslora=_bool(data.get("use_rslora", False), "use_rslora"),
        target_modules=_targets(data.get("target_modules"), all_linear),
        exclude_modules=_names(data.get("exclude_modules"), "exclude_modules"),
        layers_to_transform=_layers(data.get("layers_to_transform")),
        layers_pattern=_names(data.get("layers_pattern"), "layers_pattern", regex=False),
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    # fan_in_fan_out is not read: it concerns GPT-2's Conv1D base weights; PEFT turns it off for
    # nn.Linear targets (the only kind here) and lora_A/lora_B are stored the same either way.


def _targets(value, all_linear: tuple[str, ...]) -> tuple[str, ...] | str:
    if value is None or value == [] or value == "":
        raise LoRAError("target_modules is empty: the adapter names no module to adapt")
    if isinstance(value, str) and value.lower() == ALL_LINEAR:
        return all_linear
    return _names(value, "target_modules")


def _names(value, field: str, regex: bool = True) -> tuple[str, ...] | str:
    """A list of module names, or (regex=True) one regular expression string."""
    if value is None:
        return ()
    if isinstance(value, str):
        if not regex:
            return (value,)
        try:
            re.compile(value)
        except re.error as e:
            raise LoRAError(f"{field} {value!r} is not a valid regular expression ({e})") from e
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise LoRAError(f"{field} must be a list of module names or a regex string, got {value!r}")


def _layers(value) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None  # PEFT: no selection, every layer
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise LoRAError(f"layers_to_transform must be a layer index or a list of them, "
                        f"got {value!r}")
    return tuple(values)


def _mapping(data: dict, field: str) -> dict:
    value = data.get(field) or {}
    if not isinstance(value, dict):
        raise LoRAError(f"{field} must be an object (module pattern -> value), got {value!r}")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as e:
            raise LoRAError(f"{field} key {pattern!r} is not a valid regular expression "
                            f"({e})") from e
    return value


def _positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoRAError(f"{field} must be a positive integer, got {value!r}")
    return value


def _finite(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoRAError(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _bool(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise LoRAError(f"{field} must be true or false, got {value!r}")
    return value
