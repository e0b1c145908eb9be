"""Embedding requests: their parameters and outputs (vLLM's `PoolingParams`,
`EmbeddingRequestOutput`). Plain data: no jax.

An embedding request runs its prompt through the model like a generation request's prefill (the
same scheduler, chunks and steps), and instead of sampling it pools the final hidden states
after the final norm: the last token's, or the mean over every prompt token, L2-normalised.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from jaxserve.core.outputs import RequestMetrics
from jaxserve.core.sampling_params import SamplingParamError

# "last": the prompt's last token (vLLM's default for decoder LMs); "mean": every prompt token.
PoolingType = Literal["last", "mean"]
POOLING_TYPES = get_args(PoolingType)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """How to embed one prompt (vLLM's names).

    dimensions: the embedding's length. The served models are decoder LMs, not matryoshka
        models, so a shorter embedding would not mean anything: None or the model's hidden size
        (the engine refuses any other value). normalize: L2-normalise the pooled vector (vLLM's
        default); False returns the raw pool.
    """

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise SamplingParamError("dimensions", f"dimensions must be a positive integer or "
                                                   f"None, got {d!r}")
        if not isinstance(self.normalize, bool):
            raise SamplingParamError("normalize", f"normalize must be True or False, got "
                                                  f"{self.normalize!r}")

    def check(self, hidden_size: int) -> None:
        """Raises SamplingParamError when the model cannot give this embedding."""
        d = self.dimensions
        if d is not None and d != hidden_size:
            raise SamplingParamError(
                "dimensions", f"this model's embeddings have {hidden_size} dimensions and it "
                f"is not a matryoshka model, so they cannot be shortened: leave 'dimensions' "
                f"out or set it to {hidden_size} (got {d})")


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # [D]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput:
    """An embedding request's result; `outputs` is None until it finishes (or when it
    failed: `error` says why)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
