"""N-gram (prompt lookup) drafting over a sequence's own tokens, prompt + output.

The drafter looks for the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) earlier in the sequence and proposes the tokens that followed the most recent
such occurrence; where those run into the sequence's end, the draft goes on copying from itself
(an LZ77 copy with overlap, as llama.cpp's lookup decoding drafts from its own drafts), so a
repetition loop shorter than k drafts k tokens. Rather than scanning the sequence every step,
each sequence keeps an index n-gram -> end position of its latest occurrence, extended as tokens
are appended: a step costs O(max - min + 1) dict operations and O(k) list operations per
sequence, whatever its length (docs/speculative.md has the measured cost). Only known tokens are
indexed; drafts never are.
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

    def propose(self, seq, k: int) -> list[int]:
        """Up to k drafted tokens continuing `seq`'s known tokens (prompt + output, but a last
        id still on the device). Reads only the tokens it needs (seq.token_ids_slice): no copy
        of the sequence."""
        num = seq.num_known_tokens
        if k < 1 or num <= self.min_n:
            return []
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _Index()
        last = num - 1
        self._extend(index, seq, last)
        latest, get = index.latest, seq.token_ids_slice
        suffix = get(max(0, last - self.max_n + 1), num)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = latest.get(tuple(suffix[len(suffix) - n:]))
            if end is not None:
                draft = get(end + 1, min(end + 1 + k, num))
                # A continuation that runs into the sequence's end goes on from its own start,
                # as an LZ77 copy with overlap does: in a loop of period p < k (last - end is
                # p) the draft is k tokens long, not p.
                period = len(draft)
                for i in range(period, k):
                    draft.append(draft[i - period])
                return draft
        return []

    def _extend(self, index: _Index, seq, last: int) -> None:
        # n-grams ending at positions [indexed, last): each has a following token. A later
        # occurrence overwrites an earlier one: the most recent match wins.
        first = index.indexed
        if first >= last:
            return
        latest, lo, hi = index.latest, self.min_n, self.max_n
        base = max(0, first - hi + 1)
        tokens = seq.token_ids_slice(base, last)  # the new n-grams' tokens only
        for end in range(first, last):
            e = end - base
            for n in range(lo, min(hi, end + 1) + 1):
                latest[tuple(tokens[e - n + 1:e + 1])] = end
        index.indexed = last
