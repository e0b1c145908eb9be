"""Beam search on the block manager's fork / free machinery.

A beam is a Sequence. Each step every live beam computes its next position with top
2 * beam_width logprobs (the runner's top-logprob path on greedy rows) and is then *held*: the
scheduler advances it but appends nothing, so it waits, unscheduled, until every live beam of
the request has its candidates. Then `on_updated` ranks all (beam, token) candidates by the
beam's cumulative logprob plus the token's logprob, keeps the best beam_width and returns the
engine a Decision (decision.py) to apply through the scheduler:

- a parent chosen k times continues with its first token and is forked k - 1 times (children
  share its blocks; the first write into the shared tail block is a copy-on-write);
- a parent never chosen is freed (its blocks may stay in the prefix cache);
- a stop token (EOS unless ignore_eos, or a stop_token_id) among the best beam_width candidates
  ends a hypothesis instead of extending a beam; at max_tokens every beam ends.

The search stops when beam_width hypotheses have ended and the best live beam's score can no
longer beat the worst of them (HF's `early_stopping=False` test), or at max_tokens. The score is
cumulative_logprob / len(output tokens) ** length_penalty. A held beam that is preempted loses
nothing: its candidates stay valid (they depend only on its tokens), so the group can advance
with it waiting; its children then wait too and recompute (mostly prefix-cache hits). A beam
readmitted while still held recomputes and records the same candidates again.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.core.decision import Decision, Fork, NewId
from jaxserve.core.outputs import (CompletionOutput, RequestMetrics, RequestOutput,
                                   SampleResult)
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence, SequenceStatus
from models.tokenizer import Tokenizer

DROPPED = SequenceStatus.FINISHED_ABORTED  # internal: a beam not kept, never reported


@dataclasses.dataclass
class Beam:
    seq: Sequence
    cum_logprob: float = 0.0
    candidates: list[tuple[int, float]] | None = None  # (token, logprob), best first


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    token_ids: list[int]
    cum_logprob: float
    finish_reason: str
    score: float


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / (max(length, 1) ** length_penalty)


def search_params(params: SamplingParams) -> SamplingParams:
    """What each beam sequence runs with: greedy rows that return 2 * beam_width top logprobs."""
    return dataclasses.replace(params, n=1, use_beam_search=False, beam_width=1,
                               temperature=0.0, logprobs=2 * params.beam_width)


class BeamRequestState:
    # Beams are greedy rows without a grammar that wait for their group's ids every step, and
    # on_updated picks the group's next beams every step.
    constrained = False
    waits_for_ids = True
    speculates = False
    acts_on_every_update = True

    def __init__(self, seq: Sequence, prompt: str | None, tokenizer: Tokenizer | None,
                 params: SamplingParams, arrival_time: float, stop_ids: set[int]):
        self.request_id, self.prompt, self.params = seq.request_id, prompt, params
        self.prompt_token_ids = list(seq.prompt_token_ids)
        self.tokenizer = tokenizer
        self.seed = 0  # beams are greedy rows
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.width = params.beam_width
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else stop_ids)
        self.live: list[Beam] = [Beam(seq)]
        self.hypotheses: list[Hypothesis] = []
        self.finished = False
        self.error: str | None = None

    @property
    def num_slots(self) -> int:
        return self.width

    def matcher_of(self, seq_id: str) -> None:
        return None

    def seed_of(self, seq_id: str) -> int:
        return 0

    def on_sampled(self, item: ScheduledSeq, result: SampleResult, new_id: NewId,
                   into: Decision | None = None) -> Decision:
        """Records the beam's candidates; it is held until its whole group has them."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()
        beam = self._beam(item.request_id)
        beam.candidates = list((result.top or {}).items())[:2 * self.width]
        decision = Decision() if into is None else into
        decision.hold.add(item.request_id)
        return decision

    def on_updated(self, finished: list[Sequence], new_id: NewId) -> Decision:
        return self._advance(new_id) if self.ready else Decision()

    def fail(self, message: str) -> None:
        self.error, self.finished, self.live = message, True, []

    def _beam(self, seq_id: str) -> Beam:
        return next(b for b in self.live if b.seq.request_id == seq_id)

    @property
    def ready(self) -> bool:
        return all(b.candidates is not None for b in self.live)

    def _advance(self, new_id: NewId) -> Decision:
        """One beam step: which beams to fork, free and extend."""
        chosen = self._select()
        out_len = self.live[0].seq.num_output_tokens + 1
        if out_len >= self.params.max_tokens:  # every chosen beam ends at max_tokens
            for parent, token, score in chosen:
                self._end(self.live[parent], token, score, "length")
            chosen = []
        elif self._done([score for _, _, score in chosen], out_len):
            chosen = []
        return self._rebuild(new_id, chosen)

    def _select(self) -> list[tuple[int, int, float]]:
        cands = [(b.cum_logprob + lp, i, rank, tok)
                 for i, b in enumerate(self.live) for rank, (tok, lp) in enumerate(b.candidates)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = []
        for pos, (score, parent, _, tok) in enumerate(cands):
            if len(chosen) == self.width:
                break
            if tok in self.stop_ids:
                if pos < self.width:
                    self._end(self.live[parent], tok, score, "stop")
                continue
            chosen.append((parent, tok, score))
        return chosen

    def _end(self, beam: Beam, token: int, cum: float, reason: str) -> None:
        ids = beam.seq.output_token_ids + [token]
        self.hypotheses.append(Hypothesis(ids, cum, reason,
                                          beam_score(cum, len(ids), self.params.length_penalty)))

    def _done(self, live_scores: list[float], out_len: int) -> bool:
        if not live_scores:
            return True
        if len(self.hypotheses) < self.width:
            return False
        worst_kept = sorted((h.score for h in self.hypotheses), reverse=True)[self.width - 1]
        best_live = beam_score(max(live_scores), out_len, self.params.length_penalty)
        return worst_kept >= best_live

    def _rebuild(self, new_id: NewId, chosen) -> Decision:
        by_parent: dict[int, list[tuple[int, float]]] = {}
        for parent, tok, score in chosen:
            by_parent.setdefault(parent, []).append((tok, score))
        decision = Decision()
        # The group keeps `width` slots: each kept parent holds one per branch it spawns, the
        # first one also the slots of beams not refilled.
        spare = self.width - len(chosen)
        for parent, picks in by_parent.items():
            decision.reserve.append((self.live[parent].seq, len(picks) + spare))
            spare = 0
        new_live = []
        for i, beam in enumerate(self.live):
            picks = by_parent.get(i)
            if not picks:
                decision.free.append((beam.seq, DROPPED))
                continue
            parent = beam.seq
            for tok, score in picks[1:]:
                # The child's KV is the parent's; it computes its own pick next step.
                child = Sequence(new_id(self.request_id), parent.prompt_token_ids,
                                 parent.sampling_params, arrival_time=parent.arrival_time,
                                 cache_salt=parent.cache_salt,
                                 output_token_ids=parent.output_token_ids + [tok],
                                 priority=parent.priority, lora_id=parent.lora_id)
                decision.forks.append(Fork(parent=parent, child=child,
                                           num_computed_tokens=parent.num_computed_tokens))
                new_live.append(Beam(child, score))
            decision.append.append((parent, picks[0][0]))
            new_live.append(Beam(parent, picks[0][1]))
        self.live = new_live
        if not new_live:
            self.finished = True
        return decision

    def output(self) -> RequestOutput:
        outputs = []
        if self.error is not None:
            self.metrics.finished_time = time.monotonic()
            outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                       for i in range(self.params.n)]
        elif self.finished:
            self.metrics.finished_time = time.monotonic()
            ranked = sorted(self.hypotheses, key=lambda h: -h.score)[:self.params.n]
            for i, h in enumerate(ranked):
                text = (self.tokenizer.decode([t for t in h.token_ids if t not in self.stop_ids],
                                              skip_special_tokens=self.params.skip_special_tokens)
                        if self.tokenizer is not None else "")
                outputs.append(CompletionOutput(
                    index=i, text=text, token_ids=h.token_ids, finish_reason=h.finish_reason,
                    cumulative_logprob=h.cum_logprob, delta_text=text,
                    delta_token_ids=h.token_ids))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs,
                             finished=self.finished, metrics=self.metrics, error=self.error)
