"""Host-side state of one request: incremental detokenization and stop conditions.

A request with `n` > 1 runs as n branch sequences: branch 0 is the request's own sequence;
branches 1..n-1 are forked from it when its prompt's last chunk has run, so the prompt is
prefilled once and its blocks are shared. Each branch samples with its own seed (derived from
the request's seed and the branch index), keeps its own text and stop state, and becomes
`outputs[i]` of the RequestOutput.
"""

from __future__ import annotations

import hashlib
import time

from jaxserve.core.decision import Decision, Fork, NewId
from jaxserve.core.outputs import (CompletionOutput, RequestMetrics, RequestOutput,
                                   SampleResult)
from jaxserve.core.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence, SequenceStatus
from models.tokenizer import IncrementalDetokenizer, Tokenizer

FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop",
                  SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort",
                  SequenceStatus.FINISHED_ERROR: "error"}


def branch_seed(seed: int, index: int) -> int:
    """Branch 0 keeps the request's seed (n=1 is unchanged); others get a hash of (seed, i)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class BranchState:
    """One sequence's output: detokenized text, logprobs, stop state."""

    def __init__(self, index: int, seq: Sequence, tokenizer: Tokenizer | None, seed: int,
                 metrics: RequestMetrics):
        self.index, self.seq, self.seed = index, seq, seed
        self.params: SamplingParams = seq.sampling_params
        self.tokenizer = tokenizer
        self.detok = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                             skip_special_tokens=self.params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text = ""
        self.emitted_chars = 0  # of self.text, already handed out as delta_text
        self.emitted_tokens = 0
        self.logprobs: list[dict[int, float]] | None = [] if self.params.logprobs is not None \
            else None
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.metrics = metrics
        self.finished = False
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1
        self._stop_ids = set(self.params.stop_token_ids)
        self.matcher = None  # core/grammar.py Matcher of a constrained request, once compiled
        self.error: str | None = None  # why the grammar rejected a token

    def on_token(self, result: SampleResult, eos_ids: set[int]) -> SequenceStatus | None:
        """Records a sampled token; returns FINISHED_STOPPED if it ends the request.

        eos_ids: the engine's end-of-sequence ids (tokenizer stop tokens, else the config's).
        """
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()
        token, p = result.token, self.params
        self.cumulative_logprob += result.logprob
        if self.logprobs is not None:
            self.logprobs.append({token: result.logprob, **(result.top or {})})
        grammar_done = False
        if self.matcher is not None:
            if not self.matcher.consume(token):  # the mask should make this impossible
                self.error = f"the grammar rejected token {token}: {self.matcher.error}"
                return SequenceStatus.FINISHED_ERROR
            grammar_done = self.matcher.is_finished
        seq = self.seq
        # Counting this token, which a committed step's PLACEHOLDER already stands for.
        n_out = len(seq.output_token_ids) + (not seq.ends_in_placeholder)
        min_reached = n_out >= p.min_tokens
        if token in self._stop_ids and min_reached:
            self.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        is_eos = token in eos_ids
        if is_eos and not p.ignore_eos and min_reached:
            return SequenceStatus.FINISHED_STOPPED  # EOS: not part of the text
        if self.detok is not None:
            before = len(self.text)
            self.text += self.detok.add(token)
            if p.stop and min_reached and self._check_stop_strings(before):
                return SequenceStatus.FINISHED_STOPPED
        return SequenceStatus.FINISHED_STOPPED if grammar_done else None

    def _check_stop_strings(self, before: int) -> bool:
        # Only a match ending in the new text is new: it starts at most len(stop) - 1 characters
        # before what this token appended.
        start = max(0, before - self._hold)
        best = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[:best[0]]
        self.stop_reason = best[1]
        return True

    def output(self) -> CompletionOutput:
        """The branch's output so far; delta fields hold what is new since the last call."""
        finished = self.finished
        if finished and self.detok is not None and self.stop_reason is None:
            self.text += self.detok.flush()
            self.detok = None  # flushed once
        # While running, hold back a tail that could still grow into a stop string.
        visible = len(self.text) if finished else max(self.emitted_chars,
                                                      len(self.text) - self._hold)
        all_ids = self.seq.output_token_ids
        delta_text = self.text[self.emitted_chars:visible]
        delta_ids = all_ids[self.emitted_tokens:]
        logprobs = self.logprobs
        if self.params.output_kind is RequestOutputKind.DELTA:
            # Only what is new: no step copies the whole output.
            text, token_ids = delta_text, delta_ids
            if logprobs is not None:
                logprobs = logprobs[self.emitted_tokens:]
        else:
            text, token_ids = self.text[:visible], list(all_ids)
        self.emitted_chars, self.emitted_tokens = visible, len(all_ids)
        # Positional: built for every request every step, and keywords cost more to pass.
        return CompletionOutput(
            self.index, text, token_ids,
            FINISH_REASONS.get(self.seq.status) if finished else None,  # finish_reason
            self.stop_reason, logprobs, self.cumulative_logprob, delta_text, delta_ids)


class RequestState:
    """A request's branches (n of them once forked) and its metrics (see decision.py)."""

    acts_on_every_update = False  # on_updated acts only on ended branches

    def __init__(self, seq: Sequence, prompt: str | None, tokenizer: Tokenizer | None,
                 seed: int, arrival_time: float, eos_ids: set[int]):
        self.request_id, self.prompt, self.seed = seq.request_id, prompt, seed
        self.params: SamplingParams = seq.sampling_params
        self.prompt_token_ids = list(seq.prompt_token_ids)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.branches = [BranchState(0, seq, tokenizer, seed, self.metrics)]
        self.by_seq: dict[str, BranchState] = {seq.request_id: self.branches[0]}
        self.error: str | None = None
        # Filled position by position as the prompt's chunks run (prompt_logprobs requests).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(self.prompt_token_ids)
            if self.params.prompt_logprobs is not None else None)
        self.constrained = seq.sampling_params.constrained
        self._grammar = None  # the compiled prototype each branch copies (core/grammar.py)

    def start_grammar(self, prototype) -> None:
        """The request's grammar has compiled: every branch follows its own copy."""
        self._grammar = prototype
        for branch in self.branches:
            branch.matcher = prototype.copy()

    def matcher_of(self, seq_id: str):
        return self.by_seq[seq_id].matcher

    @property
    def seq(self) -> Sequence:
        return self.branches[0].seq

    @property
    def num_slots(self) -> int:
        return self.params.n

    @property
    def num_pending_forks(self) -> int:
        return self.params.n - len(self.branches)

    @property
    def waits_for_ids(self) -> bool:
        return bool(self.constrained or self.num_pending_forks)

    @property
    def speculates(self) -> bool:
        # A masked step has no verification variant; forks copy the prompt's state first.
        return not self.constrained and not self.num_pending_forks

    def _fork_sequences(self, new_id: NewId) -> list[Sequence]:
        """Sequences for branches 1..n-1: copies of the prompt."""
        parent = self.seq
        children = []
        for i in range(len(self.branches), self.params.n):
            child = Sequence(new_id(self.request_id), parent.prompt_token_ids,
                             parent.sampling_params, arrival_time=parent.arrival_time,
                             cache_salt=parent.cache_salt, priority=parent.priority,
                             lora_id=parent.lora_id)
            branch = BranchState(i, child, self.tokenizer, branch_seed(self.seed, i),
                                 self.metrics)
            if self._grammar is not None:
                branch.matcher = self._grammar.copy()
            self.branches.append(branch)
            self.by_seq[child.request_id] = branch
            children.append(child)
        return children

    def seed_of(self, seq_id: str) -> int:
        return self.by_seq[seq_id].seed

    def on_sampled(self, item: ScheduledSeq, result: SampleResult, new_id: NewId,
                   into: Decision | None = None) -> Decision:
        """Records the token; once branch 0's prompt has run, forks the other branches off it.

        Each branch recomputes only the last prompt token (copy-on-write of the tail block) to
        sample its own first token. Adds to `into` (the step's decision) when given.
        """
        sid = item.seq.request_id
        decision = Decision() if into is None else into
        if self.num_pending_forks and item.seq is self.seq:
            end = item.start_pos + item.num_new_tokens
            decision.forks.extend(Fork(parent=item.seq, child=child, num_computed_tokens=end - 1)
                                  for child in self._fork_sequences(new_id))
        decision.tokens[sid] = result.token
        branch = self.by_seq[sid]
        reason = branch.on_token(result, self.eos_ids)
        if reason is not None:
            decision.finished[sid] = reason
            if branch.error is not None and self.error is None:
                self.error = branch.error  # the engine ends the other branches
        return decision

    def on_prompt_logprobs(self, first: int, entries: list[dict[int, float]]) -> None:
        """Prompt positions [first, first + len(entries)) scored by a step (a recomputed
        chunk scores the same positions again, with the same values)."""
        self.prompt_logprobs[first:first + len(entries)] = entries

    def on_updated(self, finished: list[Sequence], new_id: NewId) -> Decision:
        # Acts only on `finished` (the engine skips the call when it is empty).
        for seq in finished:
            self.by_seq[seq.request_id].finished = True
        return Decision()

    def fail(self, message: str) -> None:
        self.error = message
        for branch in self.branches:
            branch.finished = True

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        branches = self.branches
        if len(branches) != self.params.n:
            return False
        for branch in branches:  # read twice per request per step: no generator
            if not branch.finished:
                return False
        return True

    def output(self) -> RequestOutput:
        finished = self.finished
        if finished:
            self.metrics.finished_time = time.monotonic()
        outputs = [b.output() for b in self.branches]
        # Positional (built for every request every step), and the request's own copy of the
        # prompt, the same list in every output, as vLLM's outputs share theirs.
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished, self.metrics, self.error, self.prompt_logprobs)
