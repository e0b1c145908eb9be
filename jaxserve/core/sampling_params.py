"""Per-request sampling parameters, validated with messages a user can act on."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.core.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 64
# Beam search ranks each beam's top 2 * beam_width tokens, read as top logprobs.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# Width of the sampler's per-slot table of ids banned while fewer than min_tokens are generated
# (the request's stop_token_ids plus the engine's EOS ids). Declared here so the engine checks
# it when a request is added, without importing the (jax) sampler.
MAX_STOP_IDS = 16


class RequestOutputKind(enum.Enum):
    """Which outputs a request's steps hand back (vLLM's names).

    CUMULATIVE: every step that advances the request returns everything generated so far (the
    `delta_*` fields hold what is new). DELTA: only what is new (`text` and `token_ids` are the
    delta), so no step copies the whole output. FINAL_ONLY: nothing until the request finishes,
    then its whole output; `LLM.generate` uses it, as it keeps only the final outputs.
    """
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; `param` names the field (the server reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _finite(name: str, value, low=None, high=None, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingParamError(name, f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise SamplingParamError(
            name, f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamError(name, f"{name} must be <= {high}, got {value}")


def _int(name: str, value, low=None, high=None, allow_none=False, param=None):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamError(param or name, f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise SamplingParamError(param or name, f"{name} must be {bounds}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and meanings).

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1 and min_p 0 disable
    nucleus and min-p filtering. repetition_penalty divides positive (multiplies negative) logits
    of tokens seen in prompt or output; presence/frequency penalties subtract from logits of
    tokens in the output (once / per occurrence). A request with a seed is reproducible and does
    not depend on which requests share its batch.

    n > 1 returns n completions of one prompt (prefilled once; each branch has its own random
    stream, reproducible with a seed). use_beam_search keeps the beam_width most likely
    continuations (sum of token logprobs; temperature and filters do not apply) and returns the
    n best finished ones, ranked by cumulative_logprob / len(output) ** length_penalty.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # core/structured_outputs.py: a JSON schema, regex, choice or grammar the output follows.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        _int("n", self.n, 1, MAX_N)
        _finite("temperature", self.temperature, 0.0)
        _finite("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, -1)
        _finite("min_p", self.min_p, 0.0, 1.0)
        _finite("repetition_penalty", self.repetition_penalty, 0.0, low_open=True)
        _finite("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _int("seed", self.seed, -(2 ** 63), 2 ** 63 - 1, allow_none=True)
        _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamError("stop", "stop strings must be non-empty strings of at "
                                         f"most {MAX_STOP_STRING_CHARS} characters")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        for t in ids:
            _int("stop_token_ids entries", t, 0, param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        _int("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        _finite("length_penalty", self.length_penalty)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamError(
                "output_kind", "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or "
                f"FINAL_ONLY), got {self.output_kind!r}")
        if self.use_beam_search:
            self._check_beam_search()
        if self.structured_outputs is not None:
            self._check_structured()

    def _check_structured(self):
        from jaxserve.core.structured_outputs import StructuredOutputs  # imports this module
        if not isinstance(self.structured_outputs, StructuredOutputs):
            raise SamplingParamError("structured_outputs", "structured_outputs must be a "
                                     "StructuredOutputs, got "
                                     f"{type(self.structured_outputs).__name__}")
        # Beam search ranks whole continuations; the constraint would have to follow every
        # beam's forks. min_tokens bans EOS, which a finished grammar needs.
        for name, off in (("use_beam_search", False), ("min_tokens", 0)):
            if getattr(self, name) != off:
                raise SamplingParamError(name, f"{name} is not supported with "
                                         f"structured_outputs (leave it at {off!r})")

    def _check_beam_search(self):
        if self.n > self.beam_width:
            raise SamplingParamError("n", f"beam search returns at most beam_width "
                                     f"({self.beam_width}) completions, got n={self.n}")
        unsupported = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                       "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
                       "stop": (), "logprobs": None, "prompt_logprobs": None}
        for name, off in unsupported.items():
            if getattr(self, name) != off:
                raise SamplingParamError(name, f"{name} is not supported with beam search "
                                         f"(leave it at {off!r})")

    @property
    def constrained(self) -> bool:
        return self.structured_outputs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def min_tokens_banned_ids(params: SamplingParams, eos_ids) -> tuple[int, ...]:
    """Ids the sampler bans while fewer than min_tokens are generated: stop_token_ids, then the
    engine's EOS ids (unless ignore_eos), deduplicated. Raises SamplingParamError past the
    sampler's MAX_STOP_IDS."""
    eos = () if params.ignore_eos else tuple(sorted(eos_ids))
    ids = tuple(dict.fromkeys(tuple(params.stop_token_ids) + eos))
    if len(ids) > MAX_STOP_IDS:
        raise SamplingParamError(
            "stop_token_ids", f"min_tokens supports at most {MAX_STOP_IDS} stop token ids (the "
            f"model's {len(eos)} EOS ids included), got {len(ids)}; pass fewer "
            f"stop_token_ids or set min_tokens=0")
    return ids


def check_servable(params: SamplingParams, eos_ids) -> None:
    """The limits that depend on the engine (its EOS ids), checked when a request is added so
    that a request the sampler cannot run is refused instead of failing inside a step."""
    if params.min_tokens > 0:
        min_tokens_banned_ids(params, eos_ids)
