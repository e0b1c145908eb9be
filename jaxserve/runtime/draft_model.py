"""Draft-model drafting: a second, smaller model run by its own ModelRunner and paged KV cache.

Each target sequence that speculates has a shadow Sequence in the draft's own block manager
(its own block table) and batch slot. A proposal (a) rolls the shadow back to the longest prefix
it shares with the target's tokens (drafts the target rejected are cut; their KV is simply
overwritten later), (b) catches up: one row with every target token the draft has not computed
yet (the token the target added, plus the last accepted draft after a full acceptance; the whole
prompt the first time), which samples the first draft, then (c) runs k - 1 single-token steps
that take their input from the device (the previous step's sample), launched back to back, and
collects the k ids at the end. The draft proposes greedily (its argmax), so the draft
distribution is a point mass and verification keeps the target distribution exactly
(core/spec_decode/acceptance.py).
"""

from __future__ import annotations

import logging

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxserve.core.step_plan import StepPlan
from jaxserve.runtime.runner import ModelRunner

log = logging.getLogger("jaxserve")


class DraftModelProposer:
    def __init__(self, draft, runner: ModelRunner, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int):
        self.draft, self.runner = draft, runner
        self.bm = BlockManager(num_blocks, block_size, enable_caching=False)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.params = SamplingParams(temperature=0.0, max_tokens=max_model_len)
        self._reserved = 0
        # target sequence id -> (target, its shadow); released once the target stops running
        # (a plain dict: the draft's slot and blocks must be given back, not just forgotten).
        self._shadows: dict[str, tuple[Sequence, Sequence]] = {}

    def __call__(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self._release_stale()
        steps = max(limits)
        self._reserved = 0  # blocks the shadows synced so far will take this call
        shadows = [self._sync(seq, seq.all_token_ids, steps) for seq in seqs]
        live = [(i, sh) for i, sh in enumerate(shadows) if sh is not None]
        if not live:
            return [[] for _ in seqs]
        catch_up = self._catch_up([sh for _, sh in live])
        pendings = [self._launch([self._row(sh, 1) for _, sh in live])
                    for _ in range(steps - 1)]  # inputs from the device: nothing waits
        first = {}
        for pending in catch_up:
            first.update(self.runner.collect(pending).samples)
        later = [self.runner.collect(p).samples for p in pendings]
        ids = [[first[sh.request_id][0].token] + [got[sh.request_id][0].token for got in later]
               for _, sh in live]  # [live, steps]
        drafts: list[list[int]] = [[] for _ in seqs]
        for (i, sh), got in zip(live, ids):
            sh.output_token_ids[-steps:] = got  # the shadow's placeholders: known now
            drafts[i] = got[:limits[i]]
        return drafts

    def _sync(self, seq: Sequence, tokens: list[int], steps: int) -> Sequence | None:
        """The shadow of `seq`, holding `tokens` (KV kept for their common prefix); None when
        the draft's cache has no room for it and `steps` drafts."""
        held = self._shadows.get(seq.request_id)
        sh = held[1] if held is not None else None
        if sh is None:  # one prompt token: the rest is output, rewritten at every sync
            sh = Sequence(seq.request_id, tokens[:1], self.params)
            sh.status = SequenceStatus.RUNNING
            self._shadows[seq.request_id] = (seq, sh)
        common = 0
        for a, b in zip(sh.all_token_ids, tokens):
            if a != b:
                break
            common += 1
        sh.output_token_ids[:] = tokens[1:]
        sh.num_computed_tokens = min(sh.num_computed_tokens, common, len(tokens) - 1)
        self.bm.truncate(sh)
        need = max(0, -(-(len(tokens) + steps) // self.bm.block_size) - len(sh.block_table))
        if need > self.bm.num_free_blocks - self._reserved:
            self._release(seq, sh)
            return None
        self._reserved += need
        return sh

    def _row(self, sh: Sequence, n: int) -> ScheduledSeq:
        """A row of the shadow's last n (uncomputed) tokens that samples the next one."""
        self.bm.allocate(sh, n)
        item = ScheduledSeq(sh, n, sh.num_computed_tokens, n > 1, True)
        sh.num_computed_tokens += n
        sh.output_token_ids.append(PLACEHOLDER)  # what this row samples (known at collect)
        return item

    def _catch_up(self, shadows: list[Sequence]):
        """Runs every uncomputed token of the shadows; the last chunk of each samples draft 1.
        Chunks follow the token budget (a long prompt the first time takes several steps)."""
        pendings = []
        left = list(shadows)
        while left:
            budget, rows, later = self.max_num_batched_tokens, [], []
            for sh in left:
                n = sh.num_uncomputed_tokens
                take = min(n, max(budget, 0))
                if take == 0:
                    later.append(sh)
                    continue
                if take < n:  # a chunk that does not sample
                    self.bm.allocate(sh, take)
                    rows.append(ScheduledSeq(sh, take, sh.num_computed_tokens, True, False))
                    sh.num_computed_tokens += take
                    later.append(sh)
                else:
                    rows.append(self._row(sh, n))
                budget -= take
            pendings.append(self._launch(rows))
            left = later
        return pendings

    def _launch(self, rows: list[ScheduledSeq]):
        out = SchedulerOutput(prefills=[r for r in rows if r.num_new_tokens > 1],
                              decodes=[r for r in rows if r.num_new_tokens == 1])
        return self.runner.launch(StepPlan(out, seeds={r.request_id: 0 for r in rows}))

    def _release_stale(self) -> None:
        for seq, sh in list(self._shadows.values()):
            if seq.status is not SequenceStatus.RUNNING:
                self._release(seq, sh)

    def _release(self, seq: Sequence, sh: Sequence) -> None:
        self.bm.free(sh)
        self.runner.release([sh.request_id])
        self._shadows.pop(seq.request_id, None)


def draft_proposer(config, *, target, draft=None, num_blocks: int,
                   max_model_len: int) -> DraftModelProposer:
    """The draft model of config.speculative_config (core/spec_decode/config.py) beside the
    `target` model: same vocabulary, batch and block shapes, its own KV cache of `num_blocks`
    blocks, and the target's program choices (backends, KV cache dtype, sampler, buckets) on
    one device, without structured outputs, fault injection or verification. draft: the draft
    model already loaded, else loaded from the spec's path."""
    from jaxserve.quantization.paths import prepare_model
    from jaxserve.runtime.runner_factory import build_runner
    from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram
    from models import load_model
    spec = config.speculative_config
    if draft is None:
        draft = load_model(spec.model, target.dtype, weights_cache=config.weights_cache)
    draft, quant = prepare_model(draft, spec.draft_quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) "
                         f"differs from the target's ({target.config.vocab_size}); "
                         "speculative decoding needs the same tokenizer")
    bs = config.block_size
    runner = build_runner(draft, RunnerSpec.from_config(
        config, num_blocks=num_blocks, max_model_len=max_model_len,
        program=StepProgram.from_config(config, params=draft.params, draft=True)),
        quantization=quant)
    if config.warmup:
        seconds = runner.warmup(progress=False)
        log.info("draft model: %d programs compiled in %.1fs", runner.num_compiled, seconds)
    # The runner's model: the weights as prepared for it, with no other copy kept.
    return DraftModelProposer(runner.model, runner, num_blocks, bs,
                              config.max_num_batched_tokens, max_model_len)
