"""Verification of drafted tokens, and the acceptance statistics speculation keeps.

A verified row scores the sequence's last token and its k drafts d_1..d_k, so the target
samples s_0..s_k, s_i at the position right after draft i (d_0 being the last real token). Every
drafter here proposes deterministically (n-gram lookup, the draft model's argmax): the draft
distribution q is a point mass on d_i. The rejection rule that keeps the target distribution p
exactly is then: accept d_i with probability p(d_i); on rejection draw from max(p - q, 0)
normalised, i.e. p without d_i. Drawing s_i from p and accepting iff s_i == d_i is that rule:
P(accept) = p(d_i), and given s_i != d_i, s_i is distributed as p restricted to tokens != d_i.
Greedy rows are the special case of an argmax. Since s_i is drawn with the sampler's key
(seed, position), a seeded request produces the same tokens with speculation as without it.

The accepted tokens are s_0..s_a, where a is the length of the longest prefix with s_i == d_i+1
(a + 1 tokens per verified row, the last one the target's own).
"""

from __future__ import annotations

import collections
import dataclasses


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """a: how many leading drafts the target's samples confirm (sampled[i] == drafts[i])."""
    a = 0
    for d, s in zip(drafts, sampled):
        if d != s:
            break
        a += 1
    return a


@dataclasses.dataclass
class SpecTotals:
    """Engine-wide speculation counters (stats() and /metrics)."""

    num_drafts: int = 0            # verified rows (one per speculating sequence per step)
    num_draft_tokens: int = 0      # drafted tokens verified
    num_accepted_tokens: int = 0   # of them accepted
    num_emitted_tokens: int = 0    # tokens the verified rows produced (accepted + 1 each)
    num_disabled: int = 0          # switch-offs for low acceptance (a sequence's, each time)
    num_resumed: int = 0           # of them turned back on (their drafts scored well again)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance_rate"] = _ratio(self.num_accepted_tokens, self.num_draft_tokens)
        d["mean_accepted_length"] = _ratio(self.num_emitted_tokens, self.num_drafts)
        return d


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


class AcceptanceWindow:
    """A sequence's last `window` verified rows' (drafted, accepted) counts; `low` once the
    window is full and its drafted tokens were accepted at a rate below the threshold.

    Counted in rows, not drafted tokens, so that the evidence behind a switch-off does not
    shrink as k grows (a window of 32 drafted tokens was 8 rows at k = 4 but 4 at k = 8)."""

    __slots__ = ("threshold", "recent", "drafted", "accepted")

    def __init__(self, window: int, threshold: float):
        self.threshold = threshold
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
        self.drafted = self.accepted = 0

    def record(self, drafted: int, accepted: int) -> bool:
        """Adds one verified row; returns whether the acceptance rate is now too low."""
        recent = self.recent
        if len(recent) == recent.maxlen:
            d, a = recent[0]  # leaves the window as the new row comes in
            self.drafted -= d
            self.accepted -= a
        recent.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        return len(recent) == recent.maxlen and self.accepted < self.threshold * self.drafted
