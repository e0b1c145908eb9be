"""Continuous-batching scheduler with chunked prefill and recompute preemption.

Each `schedule()` builds one step's batch (FCFS):

1. Running sequences, oldest first, each get their decode token or their next
   prefill chunk (only the newest can be mid-prefill, so decodes always get
   their token). If blocks run out, the newest running sequence not yet
   scheduled this step is preempted by recompute (blocks freed, put at the
   front of waiting) and the allocation retried; with nobody newer left, the
   sequence preempts itself.
2. If nobody was preempted, waiting sequences are admitted in order while a
   running slot, token budget and blocks allow. A prompt longer than the budget
   left is chunked. Admission stops at the first that does not fit, so the
   oldest waiting sequence is never overtaken. With prefix caching, an admitted
   sequence first takes the cached blocks of its longest cached prefix and
   starts computing after them (a preempted sequence may hit its own blocks).

Slots: a sequence holds `num_reserved_slots` of the `max_num_seqs` batch slots,
so a request that will fork into k branches (`fork`) reserves them up front.
A sequence with nothing uncomputed (a beam waiting for its group, see `update`'s
`hold`) stays running but is not scheduled.

`update()` applies the step's results: advances `num_computed_tokens`, appends
sampled tokens, and frees finished sequences (whose slots the next
`schedule()` refills).

Asynchronous scheduling splits that in two, so the next step can be scheduled
while this one runs: `commit()` applies a launched step's work before its ids
are known (computed tokens advanced, a PLACEHOLDER appended for each token it
samples), and, once the ids arrive, `update(..., committed=True)` writes the real
ids over the placeholders without advancing twice.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from jaxserve.core.block_manager import BlockManager, blocks_for_tokens
from jaxserve.core.kv_events import KVEventLog
from jaxserve.core.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's limits, built by `EngineConfig.scheduler_config` (jaxserve/config.py).

    EngineConfig validates the fields it holds (the batch limits, block_size, the flags); checked
    here is only what the engine derives from the model and the KV budget, `max_model_len` and
    `num_blocks`, against them.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    # Log the prefix cache's stored / removed blocks for KV-aware routers (core/kv_events.py).
    kv_events: bool = False
    # LoRA: distinct adapters running at once (the device's adapter slots); 0: no adapters.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got "
                             f"{self.max_model_len!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}); raise it or enable_chunked_prefill")
        needed = blocks_for_tokens(self.max_model_len, self.block_size)
        if not isinstance(self.num_blocks, int) or self.num_blocks - 1 < needed:
            have = max(0, (self.num_blocks if isinstance(self.num_blocks, int) else 0) - 1)
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {needed} blocks of "
                f"{self.block_size} tokens plus the null block, i.e. num_blocks >= "
                f"{needed + 1}; got num_blocks={self.num_blocks!r}, room for "
                f"{have * self.block_size} tokens. Give the KV cache more memory or lower "
                f"max_model_len to <= {have * self.block_size}")


class ScheduledSeq(NamedTuple):
    """One sequence's work this step: tokens at positions [start_pos, start_pos + n).

    `start_pos` is `seq.num_computed_tokens` when scheduled (update() advances it).
    `is_last_chunk` means the chunk reaches the sequence's last token, so the
    runner samples one token from its final position; decodes always sample.
    Immutable; a named tuple rather than a frozen dataclass because one is built for every
    scheduled sequence every step, and a tuple builds several times faster.
    """

    seq: Sequence
    num_new_tokens: int
    start_pos: int
    is_prefill_chunk: bool
    is_last_chunk: bool

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids_slice(self.start_pos, self.start_pos + self.num_new_tokens)

    @property
    def positions(self) -> range:
        return range(self.start_pos, self.start_pos + self.num_new_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    decodes: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    # (src, dst) block copies to run on device before this step's KV writes.
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            events=KVEventLog() if config.kv_events else None)
        self.waiting: deque[Sequence] = deque()
        # Admission order: index 0 is the oldest, the end is the first preempted.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Tokens run through the model, and those of them that are prompt positions.
        self.num_computed_tokens = 0
        self.num_computed_prompt_tokens = 0
        self._ids: set[str] = set()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_reserved_slots(self) -> int:
        return sum(seq.num_reserved_slots for seq in self.running)

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=False)
        self._ids.add(seq.request_id)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Waiting order: priority (lower first), then FCFS; `front`: first of its priority
        (a preempted sequence). All priorities equal: a plain append / appendleft."""
        waiting, p = self.waiting, seq.priority
        if front and (not waiting or waiting[0].priority >= p):
            waiting.appendleft(seq)
        elif not front and (not waiting or waiting[-1].priority <= p):
            waiting.append(seq)
        else:
            ahead = (lambda w: w.priority < p) if front else (lambda w: w.priority <= p)
            k = 0
            while k < len(waiting) and ahead(waiting[k]):
                k += 1
            waiting.insert(k, seq)

    def check(self, seq: Sequence) -> None:
        """Raises ValueError, naming the limit, when `add(seq)` would refuse it."""
        rid, limit = seq.request_id, self.config.max_model_len
        if rid in self._ids:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        if not seq.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt; give at least one token")
        max_tokens = seq.max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be a positive integer, "
                             f"got {max_tokens!r}")
        if seq.prompt_only:
            if seq.num_tokens > limit:
                raise ValueError(f"request {rid!r}: the prompt ({seq.num_tokens} tokens) "
                                 f"exceeds max_model_len ({limit}); shorten it")
        elif seq.num_tokens + max_tokens > limit:
            raise ValueError(
                f"request {rid!r}: prompt ({seq.num_tokens} tokens) + max_tokens "
                f"({max_tokens}) = {seq.num_tokens + max_tokens} exceeds max_model_len "
                f"({limit}); shorten the prompt or lower max_tokens to "
                f"<= {max(0, limit - seq.num_tokens)}")
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"request {rid!r} already holds cache state; add a fresh Sequence")
        if not 1 <= seq.num_reserved_slots <= self.config.max_num_seqs:
            raise ValueError(f"request {rid!r} needs {seq.num_reserved_slots} batch slots "
                             f"(one per branch) but max_num_seqs is {self.config.max_num_seqs}")

    def abort(self, request_id: str,
              status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> bool:
        """Finish `request_id` in whatever state it is, freeing its blocks."""
        if not status.is_finished:
            raise ValueError(f"abort status must be FINISHED_*, got {status}")
        for seq in self._all():
            if seq.request_id == request_id:
                self._finish(seq, status)
                return True
        return False

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """Runs `child` (a fresh Sequence holding a copy of `parent`'s tokens) on `parent`'s blocks.

        The child takes one of the parent's reserved slots and `num_computed_tokens`: the caller
        vouches that the parent's KV of those positions is written (possibly by the step that
        just ran, before `update`). The child's first write into a shared block is a
        copy-on-write.
        """
        if parent.num_reserved_slots < 2:
            raise ValueError(f"{parent.request_id!r} has no reserved slot left to fork into")
        if child.request_id in self._ids:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        if parent in self.waiting:  # preempted: the child waits too, to recompute everything
            parent.num_reserved_slots -= 1
            child.num_reserved_slots = 1
            child.status = SequenceStatus.PREEMPTED
            self.waiting.insert(self.waiting.index(parent) + 1, child)
            self._ids.add(child.request_id)
            return
        if parent not in self.running:
            raise ValueError(f"fork source {parent.request_id!r} is neither running nor waiting")
        covered = len(parent.block_table) * self.config.block_size
        if not 0 <= num_computed_tokens <= min(covered, child.num_tokens - 1):
            raise ValueError(f"fork of {parent.request_id!r}: {num_computed_tokens} computed "
                             f"tokens is out of range")
        self.block_manager.fork(parent, child)
        parent.num_reserved_slots -= 1
        child.num_reserved_slots = 1
        child.num_computed_tokens = num_computed_tokens
        child.status = SequenceStatus.RUNNING
        # Right after its parent, which has finished its prefill: only the newest running
        # sequence may be mid-prefill (see _schedule_running).
        self.running.insert(self.running.index(parent) + 1, child)
        self._ids.add(child.request_id)

    def set_reserved_slots(self, seq: Sequence, num_slots: int) -> None:
        """Sets the batch slots a live sequence holds (a beam group moving slots to the parents
        it forks next); the caller keeps the group's total unchanged."""
        self._require_live(seq)
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"{seq.request_id!r}: num_slots must be >= 1, got {num_slots!r}")
        seq.num_reserved_slots = num_slots

    def extend(self, seq: Sequence, token_id: int) -> None:
        """Appends a token chosen outside `update` (a held beam's pick): the sequence has its
        KV up to that token, so its next step is a decode (or, preempted, a recompute)."""
        self._require_live(seq)
        seq.append_token(token_id)

    def truncate(self, seq: Sequence) -> None:
        """Gives back the blocks past `seq`'s computed tokens (rejected speculative drafts)."""
        self.block_manager.truncate(seq)

    def _require_live(self, seq: Sequence) -> None:
        if seq.request_id not in self._ids or seq.is_finished:
            raise ValueError(f"{seq.request_id!r} is not a live sequence of this scheduler")

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends `seq` (running or waiting) with a FINISHED_* status, freeing its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish status must be FINISHED_*, got {status}")
        self._finish(seq, status)

    def _all(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        self._ids.discard(seq.request_id)
        if seq.ends_in_placeholder:  # ended inside a step, before update wrote its id
            seq.output_token_ids.pop()

    # ---- scheduling -----------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _chunk_size(self, n: int, budget: int) -> int:
        """Tokens to run of `n` uncomputed given `budget`; 0 means it cannot run this step."""
        if n <= budget:
            return n
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Admission order makes this safe for decodes: only the newest running
        # sequence can still be mid-prefill (it took all the budget left when
        # admitted), so every decode is handled, one token each, before it, and
        # the config guarantees budget >= max_num_seqs.
        bm, i, running = self.block_manager, 0, self.running
        chunked = self.config.enable_chunked_prefill
        while i < len(running):  # every running sequence, every step: plain attribute reads
            seq = running[i]
            num_out = len(seq.output_token_ids)
            # A committed step's placeholder that is its max_tokens-th output: it will finish
            # when the id arrives, so it is not decoded again.
            if num_out >= seq.sampling_params.max_tokens:
                i += 1
                continue
            uncomputed = len(seq.prompt_token_ids) + num_out - seq.num_computed_tokens
            n = uncomputed if uncomputed <= budget else (budget if chunked else 0)  # _chunk_size
            if n == 0:
                i += 1
                continue
            if bm.fits_in_place(seq, n):  # most decodes: no block to take, nobody to preempt
                self._emit(out, seq, n)
                budget -= n
                i += 1
                continue
            preempted_self = False
            while not bm.can_allocate(seq, n):
                # Everything after index i is newer and not yet scheduled.
                victim = self._victim(i)
                self._preempt(victim, out)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                continue  # running[i] is now the sequence after it (none: the loop ends)
            out.blocks_to_copy.extend(bm.allocate(seq, n))
            self._emit(out, seq, n)
            budget -= n
            i += 1
        return budget

    def _victim(self, i: int) -> Sequence:
        """Whom to preempt among running[i:] (not yet scheduled this step): the highest
        priority value, the newest among equals (all equal: the newest of all)."""
        running, k = self.running, len(self.running) - 1
        for j in range(k - 1, i - 1, -1):
            if running[j].priority > running[k].priority:
                k = j
        return running[k]

    def _preempt_held(self, out: SchedulerOutput) -> bool:
        """Preempts the newest held sequence (nothing to compute: a beam waiting for its group).

        Held sequences would otherwise keep their blocks while the sequence their group waits
        for cannot be admitted. They go to the back of the queue, behind the one blocked.
        """
        for seq in reversed(self.running):
            if seq.num_uncomputed_tokens == 0:
                self._preempt(seq, out, front=False)
                return True
        return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput, front: bool = True) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self._enqueue(seq, front)
        out.preempted.append(seq.request_id)
        self.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return  # most steps: no sum over the running sequences' slots
        bm, slots = self.block_manager, self.num_reserved_slots
        max_loras = self.config.max_loras
        loras = {s.lora_id for s in self.running if s.lora_id} if max_loras else set()
        skipped: list[Sequence] = []  # whose adapter finds no free slot: others go first
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.lora_id and seq.lora_id not in loras and len(loras) >= max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if slots + seq.num_reserved_slots > self.config.max_num_seqs:
                break
            cached = [] if seq.skip_prefix_cache else bm.cached_prefix(seq)
            n = self._chunk_size(seq.num_tokens - len(cached) * self.config.block_size, budget)
            if n and not bm.can_allocate(seq, n, cached) and self._preempt_held(out):
                continue  # a held sequence gave its blocks back: look again
            if n == 0 or not bm.can_allocate(seq, n, cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            # A lookup it skipped is not counted among the cache's queries.
            out.blocks_to_copy.extend(bm.allocate(seq, n, None if seq.skip_prefix_cache
                                                  else cached))
            slots += seq.num_reserved_slots
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, n)
            budget -= n
            if seq.lora_id:
                loras.add(seq.lora_id)
        self.waiting.extendleft(reversed(skipped))

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        # Once per scheduled sequence per step: plain attribute reads, not the properties.
        self.num_computed_tokens += n
        start, num_prompt = seq.num_computed_tokens, len(seq.prompt_token_ids)
        if start < num_prompt:
            self.num_computed_prompt_tokens += min(start + n, num_prompt) - start
        uncomputed = num_prompt + len(seq.output_token_ids) - start
        is_prefill = uncomputed > 1
        item = ScheduledSeq(seq, n, start, is_prefill, n == uncomputed)
        (out.prefills if is_prefill else out.decodes).append(item)

    # ---- post-step ------------------------------------------------------

    def commit(self, output: SchedulerOutput) -> None:
        """A launched step's work, applied before its sampled ids are known.

        Its sequences advance as if `update` had run, each sampling one a PLACEHOLDER token,
        so `schedule()` can plan the next step (a decode of the placeholder, whose id the
        device supplies). Call `update(..., committed=True)` once the ids arrive.
        """
        bm = self.block_manager
        # Blocks are registered as they fill: a sequence whose computed tokens stay inside its
        # registered blocks plus the one being written (most decodes) skips the call.
        block = bm.block_size if bm.enable_caching else None
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if block and seq.num_computed_tokens >= (seq.num_registered_blocks + 1) * block:
                bm.register_computed(seq)
            if item.is_last_chunk:
                seq.append_token(PLACEHOLDER)

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        finished: Mapping[str, SequenceStatus] | None = None,
        hold: frozenset[str] | set[str] = frozenset(),
        committed: bool = False,
    ) -> list[Sequence]:
        """Apply a step's results; returns the sequences that finished.

        `sampled` maps request id -> token for every item with `is_last_chunk`.
        `finished` lets the caller stop a sequence (EOS, stop string) with a
        finished status; hitting `max_tokens` finishes with FINISHED_LENGTH.
        Items aborted since `schedule()` are skipped. Sequences in `hold` (beams)
        get no token: they stay running with nothing to compute, unscheduled,
        until the caller appends one (or forks or finishes them).
        committed: the step went through `commit` (asynchronous scheduling); its
        sequences are not advanced again, each token replaces the PLACEHOLDER
        commit appended, and one preempted since still gets its token.
        """
        finished = finished or {}
        done = []
        for item in output.scheduled:  # every scheduled sequence, every step: kept lean
            seq = item.seq
            if committed:
                if seq.status.is_finished:
                    continue
            elif seq.status is not SequenceStatus.RUNNING:
                continue
            else:
                seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.register_computed(seq)
            rid = seq.request_id
            if hold and rid in hold:
                continue
            if not item.is_last_chunk:
                if rid in sampled:
                    raise ValueError(f"{rid!r} sampled before its last prefill chunk")
                continue
            token = sampled.get(rid)
            if token is None:
                raise ValueError(f"no sampled token for {rid!r}, which was due one")
            out = seq.output_token_ids
            if committed and seq.ends_in_placeholder:
                out[-1] = token  # commit's placeholder: in place, not a pop and an append
            else:
                out.append(token)
            reason = finished.get(rid) if finished else None
            if reason is None and len(out) < seq.sampling_params.max_tokens:
                continue  # most sequences, most steps: _finish_status would say None
            status = self._finish_status(seq, reason)
            if status is not None:
                self._finish(seq, status)
                done.append(seq)
        return done

    @staticmethod
    def _finish_status(seq: Sequence, reason: SequenceStatus | None) -> SequenceStatus | None:
        if reason is not None:
            if not reason.is_finished:
                raise ValueError(f"finish reason for {seq.request_id!r} must be a FINISHED_* "
                                 f"status, got {reason}")
            return reason
        if seq.num_output_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None
