"""What the engine hands back (vLLM-shaped request and completion outputs), and what one step
samples for a sequence (`SampleResult`, the runner's answer to the engine)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding (core/spec_decode): verified rows, drafted tokens, accepted drafts,
    # and tokens the verified rows emitted (accepted + the target's own, per row).
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens \
            else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per verified row (accepted drafts + 1)."""
        return self.spec_emitted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time


# Slotted: one of each is built for every request that progresses, every step, and a slotted
# instance builds in about half the time (no per-instance __dict__).
@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {id: logprob} (sampled + top-k)
    cumulative_logprob: float = 0.0
    delta_text: str = ""  # text new since the previous output of this request (streaming)
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why the request failed inside a step (finish_reason "error")
    # With SamplingParams.prompt_logprobs: per prompt token {its id: logprob given the tokens
    # before it, **top-k}; None for the first token (nothing predicts it), as vLLM's.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclasses.dataclass(slots=True)
class SampleResult:
    """One sequence's sampled token from one step, as the runner hands it to the host.

    Not frozen (treat it as read-only): one is built for every sampling row of every step, and
    a frozen dataclass's __init__ costs several times a plain one's."""

    token: int
    logprob: float
    top: dict[int, float] | None  # top-k logprobs when the request asked for them
