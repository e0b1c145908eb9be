"""The contract between the engine and a request's host state (n branches, or a beam group).

After each step the engine hands every request state its sequences' sampled results, then the
sequences the scheduler finished, and gets back a `Decision`: plain data saying what should
happen to the request's sequences. The engine applies it through the scheduler; a request state
never writes into a Sequence the scheduler owns nor calls the scheduler itself, so the two kinds
of request (`RequestState`, `BeamRequestState`) differ only in the decisions they return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from jaxserve.core.outputs import RequestOutput, SampleResult
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence, SequenceStatus

# The engine's source of fresh sequence ids for a request (unique among live ones): one
# callable for every request, so none is made per request per step.
NewId = Callable[[str], str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fork:
    """Run `child` (a new Sequence: `parent`'s tokens, maybe plus some) on `parent`'s blocks,
    with its first `num_computed_tokens` positions' KV taken as written (Scheduler.fork)."""

    parent: Sequence
    child: Sequence
    num_computed_tokens: int


@dataclasses.dataclass(kw_only=True)
class Decision:
    """What to do with a request's sequences; the engine applies the fields in this order.

    reserve: (sequence, batch slots it holds from now on), before the forks that use them.
    forks: children to start on a parent's blocks (before `update` when the parent just ran).
    tokens / finished / hold: this step's part of Scheduler.update, by sequence id: the token
        to append, the status that ends a sequence with it, and the sequences that ran but take
        no token yet (a beam waiting for its group).
    append: (sequence, token) for sequences held since an earlier step (a beam's pick).
    free: (sequence, status) for sequences that end without a new token (a beam not kept).
    """

    reserve: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    forks: list[Fork] = dataclasses.field(default_factory=list)
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    finished: dict[str, SequenceStatus] = dataclasses.field(default_factory=dict)
    hold: set[str] = dataclasses.field(default_factory=set)
    append: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    free: list[tuple[Sequence, SequenceStatus]] = dataclasses.field(default_factory=list)

    def merge(self, other: Decision) -> None:
        for name in _DECISION_FIELDS:  # once per sampled sequence per step: no fields() call
            mine, theirs = getattr(self, name), getattr(other, name)
            if not theirs:
                continue
            if isinstance(mine, list):
                mine.extend(theirs)
            else:  # dict or set
                mine.update(theirs)


    def without(self, seq_ids: set[str]) -> Decision:
        """This decision less what it says about the sequences `seq_ids` (of requests that
        failed while it was gathered)."""
        def live(seq: Sequence) -> bool:
            return seq.request_id not in seq_ids

        return Decision(
            reserve=[(s, n) for s, n in self.reserve if live(s)],
            forks=[f for f in self.forks if live(f.parent)],
            tokens={k: v for k, v in self.tokens.items() if k not in seq_ids},
            finished={k: v for k, v in self.finished.items() if k not in seq_ids},
            hold=self.hold - seq_ids,
            append=[(s, t) for s, t in self.append if live(s)],
            free=[(s, st) for s, st in self.free if live(s)])


_DECISION_FIELDS = tuple(f.name for f in dataclasses.fields(Decision))


class RequestStateProtocol(Protocol):
    """What the engine asks of a request's host state."""

    request_id: str
    params: SamplingParams  # its output_kind says whether an unfinished step is reported

    @property
    def num_slots(self) -> int:
        """Batch slots the request's first sequence reserves at admission (one per branch)."""

    @property
    def finished(self) -> bool: ...

    # The step loop's questions (no isinstance on states in the engine):
    constrained: bool  # a grammar constrains its tokens (structured output)
    # Whether on_updated acts on a step that ended none of its sequences (beams: every step).
    acts_on_every_update: bool

    @property
    def waits_for_ids(self) -> bool:
        """Whether the next step must wait for this step's ids (it forks or picks beams on
        them, or its grammar's next mask follows from them)."""

    @property
    def speculates(self) -> bool:
        """Whether its sequences may run speculative drafts (with a speculative_config)."""

    def matcher_of(self, seq_id: str):
        """The grammar state (core/grammar.py Matcher) of a constrained sequence, else None."""

    def seed_of(self, seq_id: str) -> int:
        """The sampling seed of one of the request's sequences."""

    def on_sampled(self, item: ScheduledSeq, result: SampleResult, new_id: NewId,
                   into: Decision | None = None) -> Decision:
        """`item` ran and sampled `result` (before Scheduler.update applies the step).

        Adds to `into` when given (the engine gathers one decision per step, instead of one
        per sequence merged into it) and returns it; else returns a new Decision."""

    def on_prompt_logprobs(self, first: int, entries: list[dict[int, float]]) -> None:
        """A step scored prompt positions [first, first + len(entries)) (only for requests
        with SamplingParams.prompt_logprobs, which beam search refuses)."""

    def on_updated(self, finished: list[Sequence], new_id: NewId) -> Decision:
        """After Scheduler.update: `finished` are the request's sequences it ended."""

    def fail(self, message: str) -> None:
        """The request failed inside a step; the engine has ended all its sequences."""

    def output(self) -> RequestOutput: ...
