"""`SpeculativeConfig`: which drafter proposes tokens and how many, validated on construction.

Accepted as an object, a dict in vLLM's form (`speculative_config={"method": "ngram",
"num_speculative_tokens": 4}`) or that dict as JSON text (the CLI's `--speculative-config`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal, get_args

Method = Literal["ngram", "draft_model"]
METHODS = get_args(Method)
# vLLM spells the draft-model method "draft_model"; older configs name only a model.
_ALIASES = {"draft": "draft_model", "[ngram]": "ngram"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup over the sequence's own tokens) or "draft_model".
    num_speculative_tokens: tokens drafted per step (k); a verified row has k + 1 queries.
    prompt_lookup_min / max: n-gram sizes matched at the end of the sequence (longest first).
    model: the draft model (name, path) for "draft_model"; draft_quantization: its weights'
    path (e.g. "w8a8"), so the target's own weights can serve as a cheaper draft.
    disable_window / disable_threshold: speculation stops for a sequence once the tokens
    drafted in its last `disable_window` verified rows were accepted at a rate below
    `disable_threshold`.
    """

    method: Method = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_quantization: str | None = None
    disable_window: int = 8
    disable_threshold: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got "
                             f"{self.method!r}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1),
                          ("prompt_lookup_max", 1), ("disable_window", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative_config.{name} must be an integer >= {low}, got "
                                 f"{value!r}")
        if self.num_speculative_tokens > 15:
            # A verified row of k + 1 queries stays within one 16-query attention chunk.
            raise ValueError("speculative_config.num_speculative_tokens must be <= 15, got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        t = self.disable_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
            raise ValueError(f"speculative_config.disable_threshold must be in [0, 1], got {t!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config.method="draft_model" needs "model": the draft '
                             "model's name or path")
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config.model is for method="draft_model"; the n-gram '
                             "drafter needs no model")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig, a dict of its fields (vLLM's keys) or JSON text of one."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}; "
                                 "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                                 "4}'") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got "
                             f"{type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{sorted(fields)}")
        kwargs = dict(value)
        if "method" in kwargs:
            kwargs["method"] = _ALIASES.get(kwargs["method"], kwargs["method"])
        elif kwargs.get("model"):
            kwargs["method"] = "draft_model"
        return cls(**kwargs)
