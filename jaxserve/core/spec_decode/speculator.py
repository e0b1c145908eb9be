"""The engine's speculation bookkeeping: drafts attached to sequences for one step, verified
against the target's samples, and the per-sequence switch-off.

Protocol, once per step (engine.py): `propose(seqs, budget)` appends each speculating
sequence's drafts to its output (so the scheduler gives it a row of 1 + k tokens and blocks for
them); `strip(seq)` takes them off a sequence that will not run them (preempted); after the step,
`verify(seq, sampled, metrics)` takes them off again and returns how many the target accepted.
Drafts never reach the prefix cache: they are off the sequence before its blocks are
registered.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

from jaxserve.core.sequence import Sequence
from jaxserve.core.spec_decode.acceptance import AcceptanceWindow, SpecTotals, accepted_length
from jaxserve.core.spec_decode.config import SpeculativeConfig

# (sequences, drafts allowed each) -> drafts of each. A proposer reads a sequence's tokens
# itself (all known when it is called: prompt + output), only as far as it needs them.
BatchProposer = Callable[[list[Sequence], list[int]], list[list[int]]]


class _SeqSpec:
    __slots__ = ("window", "disabled", "drafts", "shadow")

    def __init__(self, config: SpeculativeConfig):
        self.window = AcceptanceWindow(config.disable_window, config.disable_threshold)
        self.disabled = False
        self.drafts: list[int] = []  # on the sequence's output this step
        # While switched off: (position, drafts) the drafter proposed there, not yet scored.
        self.shadow: tuple[int, list[int]] | None = None


class Speculator:
    """score_while_off: a switched-off sequence's drafter still proposes (host only, nothing
    runs on the device) and its proposals are scored against the tokens the target produces,
    in the same window; speculation resumes once the window's rate is back at the threshold.
    For a drafter that costs little to run (n-gram), so that a sequence whose output turns
    from free text into copying (or into a repetition loop) speculates again."""

    def __init__(self, config: SpeculativeConfig, proposer: BatchProposer, max_model_len: int,
                 score_while_off: bool = False):
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.score_while_off = score_while_off
        self.totals = SpecTotals()
        self._seqs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pending: dict[str, Sequence] = {}  # sequences carrying drafts now
        self._off: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # scored while off

    def _spec(self, seq: Sequence) -> _SeqSpec:
        spec = self._seqs.get(seq)
        if spec is None:
            spec = self._seqs[seq] = _SeqSpec(self.config)
        return spec

    def wants(self, seq: Sequence) -> bool:
        """Whether `seq` still speculates (its acceptance has not switched it off)."""
        spec = self._seqs.get(seq)
        return spec is None or not spec.disabled

    def allowed(self, seq: Sequence) -> int:
        """Drafts `seq` may take now: none past max_tokens (a verified row emits up to k + 1
        tokens) or max_model_len, none unless it is decoding with a known last token."""
        if seq.num_uncomputed_tokens != 1 or seq.ends_in_placeholder:
            return 0
        left = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def propose(self, seqs: Iterable[Sequence], budget: int) -> dict[str, int]:
        """Drafts for `seqs` (decoding, eligible), at most `budget` drafted tokens in all;
        appends them to each sequence's output. Returns sequence id -> number drafted."""
        chosen, limits = [], []
        for seq in seqs:
            k = min(self.allowed(seq), budget)
            if k > 0 and self.wants(seq):
                chosen.append(seq)
                limits.append(k)
                budget -= k
        if not chosen:
            return {}
        drafts = self.proposer(chosen, limits)
        proposed = {}
        for seq, k, d in zip(chosen, limits, drafts):
            d = list(d[:k])
            if d:
                self._spec(seq).drafts = d
                seq.output_token_ids.extend(d)
                proposed[seq.request_id] = len(d)
                self._pending[seq.request_id] = seq
        return proposed

    def strip(self, seq: Sequence) -> int:
        """Takes this step's drafts off `seq`'s output; returns how many there were."""
        spec = self._seqs.get(seq)
        if spec is None or not spec.drafts:
            return 0
        n = len(spec.drafts)
        del seq.output_token_ids[-n:]
        spec.drafts = []
        self._pending.pop(seq.request_id, None)
        return n

    def strip_pending(self, keep) -> None:
        """Strips the drafts of every sequence carrying some, but those whose id is in `keep`."""
        for sid, seq in list(self._pending.items()):
            if sid not in keep:
                self.strip(seq)

    def verify(self, seq: Sequence, sampled: list[int], metrics=None) -> int:
        """The number of drafts the target's samples s_0..s_k accept; strips the drafts and
        records the acceptance (per request in `metrics`, engine-wide, and for the switch-off).
        """
        spec = self._spec(seq)
        drafts = spec.drafts
        if len(sampled) != len(drafts) + 1:
            raise ValueError(f"{seq.request_id!r}: {len(sampled)} samples for {len(drafts)} "
                             f"drafts (want k + 1)")
        a = accepted_length(drafts, sampled)
        self.strip(seq)
        t = self.totals
        t.num_drafts += 1
        t.num_draft_tokens += len(drafts)
        t.num_accepted_tokens += a
        t.num_emitted_tokens += a + 1
        if metrics is not None:
            metrics.spec_num_drafts += 1
            metrics.spec_draft_tokens += len(drafts)
            metrics.spec_accepted_tokens += a
            metrics.spec_emitted_tokens += a + 1
        if spec.window.record(len(drafts), a) and not spec.disabled:
            spec.disabled = True
            t.num_disabled += 1
            if self.score_while_off:
                self._off[seq.request_id] = seq
        return a

    def score_off(self) -> None:
        """Scores the switched-off sequences' last proposals against the tokens since known
        (a proposal counts as a verified row would: drafted, and accepted up to the first
        mismatch), turns speculation back on for those whose window is no longer low, and asks
        the drafter for the others' next proposals. Only known tokens are read: with
        asynchronous scheduling a sequence's last id may still be on the device."""
        if not self._off:
            return
        ask = []
        for sid, seq in list(self._off.items()):
            if seq.is_finished:
                del self._off[sid]
                continue
            spec = self._seqs[seq]
            if spec.shadow is not None:
                pos, drafts = spec.shadow
                known = seq.token_ids_slice(pos, min(seq.num_known_tokens, pos + len(drafts)))
                a = accepted_length(drafts, known)
                if a == len(known) < len(drafts):
                    continue  # every known token agrees so far: not decided yet
                spec.shadow = None
                if not spec.window.record(len(drafts), a):
                    spec.disabled = False
                    self.totals.num_resumed += 1
                    del self._off[sid]
                    continue
            ask.append(seq)
        if ask:
            k = self.config.num_speculative_tokens
            for seq, d in zip(ask, self.proposer(ask, [k] * len(ask))):
                if d:
                    self._seqs[seq].shadow = (seq.num_known_tokens, list(d[:k]))
