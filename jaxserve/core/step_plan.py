"""The step contract: what the engine hands the runner each step, and what it gets back.

In the spirit of vLLM v1's `SchedulerOutput` -> `ModelRunnerOutput`: the engine turns the
scheduler's decision plus each feature's part of the step (speculative drafts, grammar rows,
fault injection) into one frozen `StepPlan`; the runner consumes nothing else. It answers with
one `StepResult`: every sampling sequence's samples, always a list (one sample, or the k + 1 of a
verified drafted row). The runner owns batch slots; the plan says which sequences gave theirs up.
Plain data: no jax here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxserve.core.outputs import SampleResult
from jaxserve.core.scheduler import SchedulerOutput

# Writes each (matcher, row)'s next-token bitmask into mask[row] (mask [R, W] int32):
# core/grammar.py GrammarCompiler.fill.
MaskFill = Callable[[Any, Sequence[tuple[Any, int]]], None]


@dataclasses.dataclass(frozen=True)
class GrammarRows:
    """The constrained rows that sample this step: sequence id -> grammar state (a
    core/grammar.py Matcher), and the function that writes their bitmasks."""

    matchers: Mapping[str, Any]
    fill: MaskFill


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step, as the runner consumes it.

    schedule: the scheduler's decision: rows (prefill chunks, then decodes), copy-on-write
        block pairs to copy first, and the sequences it preempted.
    seeds: sequence id -> sampling seed, for every scheduled row (the runner writes the seed,
        with the sequence's sampling parameters, when the sequence takes a batch slot).
    released: sequences whose batch slots are free before this step runs (ended or preempted
        since the last plan): the runner is the one owner of slots and frees only these.
    drafts: sequence id -> k for rows whose last k tokens are drafts (speculative decoding):
        the step samples after each of their last k + 1 queries.
    grammar: the constrained rows (structured output), or None.
    poison: sequence id -> value added to its logits rows (fault injection), or None.
    lora_slots: lora_int_id -> device slot of every adapter the scheduled rows use (the
        runner writes a new sequence's slot with its batch slot); empty without adapters.
    lora_loads: (device slot, adapter weights) to write before the step runs: adapters that
        take a slot this step (models/lora_weights.py AdapterWeights, opaque here).
    pooled: sequence id -> pooling ("last" | "mean") of the embedding rows (core/pooling.py):
        the step also returns each one's sum of final hidden states (runtime/pooling.py);
        empty in a step without them, which runs the plain program.
    """

    schedule: SchedulerOutput
    seeds: Mapping[str, int]
    released: tuple[str, ...] = ()
    drafts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    grammar: GrammarRows | None = None
    poison: Mapping[str, float] | None = None
    lora_slots: Mapping[int, int] = dataclasses.field(default_factory=dict)
    lora_loads: tuple[tuple[int, Any], ...] = ()
    pooled: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """A finished step: sequence id -> its samples in position order (one for a plain row, the
    k + 1 of a verified drafted row), for every row that sampled; `all_finite`: whether every
    sampled logprob is finite (a row of NaN/inf logits samples a non-finite one). `pooled`:
    sequence id -> float32 [D] numpy array, the pooled sum of each embedding row that pooled
    tokens this step (StepPlan.pooled). `prompt_logprobs`: sequence id -> (first prompt
    position, its entries {token: logprob, **top-k} in position order) for rows that asked for
    prompt logprobs."""

    samples: dict[str, list[SampleResult]]
    all_finite: bool = True
    pooled: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = dataclasses.field(
        default_factory=dict)
