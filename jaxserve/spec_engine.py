"""Speculative decoding in the engine loop: drafts before scheduling, verification after.

Each step (LLMEngine.step): the speculating sequences get their drafts appended
(`before_schedule`), so the scheduler gives each a row of 1 + k tokens (and blocks, preempting
as usual); sequences preempted meanwhile lose their drafts (`after_schedule`); the runner samples
at each of a drafted row's last k + 1 queries; `postprocess` then takes the drafts off, counts
the accepted ones (core/spec_decode/acceptance.py) and applies the a + 1 emitted tokens as a + 1
ordinary decode results, one round each, so stop tokens, stop strings, max_tokens, min_tokens
and logprobs follow the same code as without speculation. Blocks past the accepted tokens go back
to the pool (BlockManager.truncate).

Verification steps run synchronously: a sequence's next drafts follow from the ids it accepted,
so the next step cannot be scheduled before they are known. Steps in which no sequence still
speculates stay asynchronous. Constrained, beam-search and n > 1-in-fork requests do not
speculate (their steps are synchronous for their own reasons; a mask per point is not built).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.request_state import RequestState
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import SequenceStatus
from jaxserve.core.spec_decode.config import SpeculativeConfig
from jaxserve.core.spec_decode.ngram import NgramProposer
from jaxserve.core.spec_decode.speculator import BatchProposer, Speculator


def ngram_batch_proposer(config: SpeculativeConfig) -> BatchProposer:
    ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(seqs, limits):
        return [ngram.propose(s, k) for s, k in zip(seqs, limits)]
    return propose


class EngineSpeculation:
    def __init__(self, config: SpeculativeConfig, proposer: BatchProposer, *,
                 max_model_len: int, max_num_batched_tokens: int):
        # Proposing costs an n-gram lookup: a switched-off sequence's proposals are scored.
        self.speculator = Speculator(config, proposer, max_model_len,
                                     score_while_off=config.method == "ngram")
        self.max_num_batched_tokens = max_num_batched_tokens

    def _eligible(self, engine, seq) -> bool:
        state = engine._owner.get(seq.request_id)
        return (type(state) is RequestState and not state.constrained
                and not state.num_pending_forks and self.speculator.wants(seq))

    def needs_ids(self, engine, out: SchedulerOutput) -> bool:
        """Whether a sequence of `out` will speculate next: its ids are needed first."""
        return any(self._eligible(engine, i.seq) for i in out.scheduled)

    def before_schedule(self, engine) -> dict[str, int]:
        """Appends drafts to the running decodes that speculate; returns id -> drafts."""
        self.speculator.score_off()
        if engine._constrained:  # a masked step has no verification variant
            return {}
        running = engine.scheduler.running
        # Every running sequence gets at least its decode token before any draft: rows must
        # fit the step's token budget whole, never be split into chunks.
        budget = self.max_num_batched_tokens - len(running)
        return self.speculator.propose([s for s in running if self._eligible(engine, s)], budget)

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

    def postprocess(self, engine, out: SchedulerOutput, items: dict[str, ScheduledSeq],
                    sampled: dict, drafts: dict[str, int]) -> list:
        """Applies a verification step's results (engine._postprocess, once per round)."""
        first, extra, rows = {}, {}, []
        for sid, result in sampled.items():
            if not isinstance(result, tuple):
                first[sid] = result
                continue
            item = items[sid]
            metrics = engine._owner[sid].metrics
            a = self.speculator.verify(item.seq, [r.token for r in result], metrics)
            first[sid], extra[sid] = result[0], result[1:a + 1]
            # The row as the decode of the sequence's last token; the accepted drafts' KV is
            # written, and each later round decodes one of them.
            items[sid] = ScheduledSeq(item.seq, 1, item.start_pos, False, True)
            rows.append(items[sid])
        self.speculator.strip_pending(keep=())  # aborted meanwhile: nothing to verify
        out = dataclasses.replace(
            out, prefills=[i for i in out.prefills if i.request_id not in drafts],
            decodes=out.decodes + rows + [i for i in out.prefills
                                          if i.request_id in drafts and i.request_id not in extra])
        outputs = engine._postprocess(out, items, first, committed=False)
        for j in range(max((len(e) for e in extra.values()), default=0)):
            live = {sid: e[j] for sid, e in extra.items() if len(e) > j and sid in engine._owner
                    and items[sid].seq.status is SequenceStatus.RUNNING}
            if not live:
                break
            its = {sid: ScheduledSeq(items[sid].seq, 1, items[sid].seq.num_computed_tokens,
                                     False, True) for sid in live}
            outputs += engine._postprocess(SchedulerOutput(decodes=list(its.values())), its,
                                           live, committed=False)
        bm = engine.scheduler.block_manager
        for sid in extra:
            seq = items[sid].seq
            if seq.status is SequenceStatus.RUNNING:
                bm.truncate(seq)
        return outputs

    def stats(self) -> dict:
        return self.speculator.totals.to_dict()
