"""N-gram (prompt lookup) drafting over a sequence's own tokens, prompt + output.

The drafter looks for the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) earlier in the sequence and proposes the tokens that followed the most recent
such occurrence. Rather than scanning the sequence every step, each sequence keeps an index
n-gram -> end position of its latest occurrence, extended as tokens are appended: a step costs
O(max - min + 1) dict operations per sequence, whatever its length (docs/speculative.md has the
measured cost). Only known tokens are indexed; drafts never are.
"""

from __future__ import annotations

import weakref


class _Index:
    """n-gram (a tuple) -> end position of its latest occurrence that has a following token."""

    __slots__ = ("latest", "indexed")

    def __init__(self) -> None:
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `latest`


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        # Keyed by the Sequence object: the index goes away with its sequence.
        self._indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, seq, tokens: list[int], k: int) -> list[int]:
        """Up to k drafted tokens continuing `tokens` (seq's known prompt + output ids)."""
        if k < 1 or len(tokens) <= self.min_n:
            return []
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _Index()
        last = len(tokens) - 1
        self._extend(index, tokens, last)
        latest = index.latest
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = latest.get(tuple(tokens[last - n + 1:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []

    def _extend(self, index: _Index, tokens: list[int], last: int) -> None:
        # n-grams ending at positions [indexed, last): each has a following token. A later
        # occurrence overwrites an earlier one: the most recent match wins.
        latest, lo, hi = index.latest, self.min_n, self.max_n
        for end in range(index.indexed, last):
            for n in range(lo, min(hi, end + 1) + 1):
                latest[tuple(tokens[end - n + 1:end + 1])] = end
        index.indexed = max(index.indexed, last)
