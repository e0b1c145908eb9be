"""Speculative decoding in the engine loop: drafts before scheduling, verification after.

Each step (LLMEngine.step): the speculating sequences get their drafts appended
(`propose`), so the scheduler gives each a row of 1 + k tokens (and blocks, preempting
as usual); sequences preempted meanwhile lose their drafts (`after_schedule`); the runner samples
at each of a drafted row's last k + 1 queries; `accept` then takes the drafts off, counts
the accepted ones (core/spec_decode/acceptance.py) and applies the a + 1 emitted tokens as a + 1
ordinary decode results, one round each, so stop tokens, stop strings, max_tokens, min_tokens
and logprobs follow the same code as without speculation. Blocks past the accepted tokens go back
to the pool (Scheduler.truncate).

Verification steps run synchronously: a sequence's next drafts follow from the ids it accepted,
so the next step cannot be scheduled before they are known. Steps in which no sequence still
speculates stay asynchronous. Constrained, beam-search and n > 1-in-fork requests do not
speculate (their steps are synchronous for their own reasons; a mask per point is not built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxserve.core.outputs import RequestOutput, SampleResult
from jaxserve.core.request_table import RequestTable
from jaxserve.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.core.spec_decode.config import SpeculativeConfig
from jaxserve.core.spec_decode.ngram import NgramProposer
from jaxserve.core.spec_decode.speculator import BatchProposer, Speculator


def ngram_batch_proposer(config: SpeculativeConfig) -> BatchProposer:
    ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(seqs, limits):
        return [ngram.propose(s, k) for s, k in zip(seqs, limits)]
    return propose


# The engine's way to apply a step's sampled ids (one round of a verification step):
# (schedule, items by sequence id, sequence id -> [its sample]) -> the outputs of that round.
Apply = Callable[[SchedulerOutput, dict[str, ScheduledSeq], dict[str, list[SampleResult]]],
                 list[RequestOutput]]


class EngineSpeculation:
    """The engine's speculative decoding hooks: `propose` before scheduling, `after_schedule`,
    `needs_ids` (whether the next step must wait for this one's ids) and `accept` after a
    verification step. It reads the request table (which requests speculate) and asks the
    scheduler to give back rejected drafts' blocks; it never sees the engine."""

    def __init__(self, config: SpeculativeConfig, proposer: BatchProposer, *,
                 requests: RequestTable, scheduler: Scheduler, max_model_len: int,
                 max_num_batched_tokens: int):
        # Proposing costs an n-gram lookup: a switched-off sequence's proposals are scored.
        self.speculator = Speculator(config, proposer, max_model_len,
                                     score_while_off=config.method == "ngram")
        self.requests, self.scheduler = requests, scheduler
        self.max_num_batched_tokens = max_num_batched_tokens

    def _eligible(self, seq: Sequence) -> bool:
        state = self.requests.owner.get(seq.request_id)
        return state is not None and state.speculates and self.speculator.wants(seq)

    def needs_ids(self, out: SchedulerOutput) -> bool:
        """Whether a sequence of `out` will speculate next: its ids are needed first."""
        return any(self._eligible(i.seq) for i in out.scheduled)

    def propose(self, masked: bool) -> dict[str, int]:
        """Appends drafts to the running decodes that speculate; returns id -> drafts.
        masked: a constrained request is running (a masked step has no verification
        variant, so nothing is drafted)."""
        self.speculator.score_off()
        if masked:
            return {}
        running = self.scheduler.running
        # Every running sequence gets at least its decode token before any draft: rows must
        # fit the step's token budget whole, never be split into chunks.
        budget = self.max_num_batched_tokens - len(running)
        return self.speculator.propose([s for s in running if self._eligible(s)], budget)

    def after_schedule(self, out: SchedulerOutput, drafts: dict[str, int]) -> dict[str, int]:
        """Takes the drafts off sequences preempted by this schedule; returns the drafts that
        run. The token budget keeps every drafted row whole (never a chunk)."""
        if not drafts:
            return drafts
        running = {}
        for item in out.scheduled:
            k = drafts.get(item.request_id)
            if k is None:
                continue
            if not (item.is_last_chunk and item.num_new_tokens == k + 1):
                raise RuntimeError(f"{item.request_id!r}: its drafted row of {k + 1} tokens was "
                                   f"scheduled as {item.num_new_tokens}")
            running[item.request_id] = k
        self.speculator.strip_pending(keep=running)
        return running

    def accept(self, out: SchedulerOutput, items: dict[str, ScheduledSeq],
               samples: dict[str, list[SampleResult]], drafts: dict[str, int],
               apply: Apply) -> list[RequestOutput]:
        """Verifies a step's drafts and applies the emitted tokens through `apply`, one round
        per token: the a accepted drafts and the token after them."""
        first, extra, rows = {}, {}, []
        for sid, result in samples.items():
            if sid not in drafts:
                first[sid] = result
                continue
            item = items[sid]
            metrics = self.requests.owner[sid].metrics
            a = self.speculator.verify(item.seq, [r.token for r in result], metrics)
            first[sid], extra[sid] = result[:1], result[1:a + 1]
            # The row as the decode of the sequence's last token; the accepted drafts' KV is
            # written, and each later round decodes one of them.
            items[sid] = ScheduledSeq(item.seq, 1, item.start_pos, False, True)
            rows.append(items[sid])
        self.speculator.strip_pending(keep=())  # aborted meanwhile: nothing to verify
        out = dataclasses.replace(
            out, prefills=[i for i in out.prefills if i.request_id not in drafts],
            decodes=out.decodes + rows + [i for i in out.prefills
                                          if i.request_id in drafts and i.request_id not in extra])
        outputs = apply(out, items, first)
        owner = self.requests.owner
        for j in range(max((len(e) for e in extra.values()), default=0)):
            live = {sid: [e[j]] for sid, e in extra.items() if len(e) > j and sid in owner
                    and items[sid].seq.status is SequenceStatus.RUNNING}
            if not live:
                break
            its = {sid: ScheduledSeq(items[sid].seq, 1, items[sid].seq.num_computed_tokens,
                                     False, True) for sid in live}
            outputs += apply(SchedulerOutput(decodes=list(its.values())), its, live)
        for sid in extra:
            seq = items[sid].seq
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.truncate(seq)
        return outputs

    def stats(self) -> dict:
        return self.speculator.totals.to_dict()


def speculation(config: SpeculativeConfig | None, *, requests: RequestTable,
                scheduler: Scheduler, max_model_len: int, max_num_batched_tokens: int,
                draft: Callable[[], BatchProposer]) -> EngineSpeculation | None:
    """The engine's speculative decoding, or None without a speculative_config.
    draft: builds the draft-model proposer (runtime/draft_model.py), called for that method."""
    if config is None:
        return None
    proposer = ngram_batch_proposer(config) if config.method == "ngram" else draft()
    return EngineSpeculation(config, proposer, requests=requests, scheduler=scheduler,
                             max_model_len=max_model_len,
                             max_num_batched_tokens=max_num_batched_tokens)
