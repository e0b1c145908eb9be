"""Sampling points of a speculative (verification) step.

A plain step samples once per row, after its last query (`logits_index`). A verification step
samples after each of a drafted row's last k + 1 queries (the sequence's last token and its k
drafts) and once after every other sampling row's last query: these are its points. Each point
is (flat token index, batch slot, position of the token it samples, writes the slot's last
token); padding points sample the idle slot and write nothing. The number of points is fixed per
token bucket, so the verification variant of a bucket is one more compiled program.
"""

from __future__ import annotations

import numpy as np

from jaxserve.runtime.step_layout import Layout, num_rows

POINT_FIELDS = ("logits_index", "slot", "position", "writes")


def num_points(tokens: int, max_num_seqs: int, num_speculative_tokens: int) -> int:
    """Points of a verification step of `tokens` flat tokens: at most one per query token, and
    at most k + 1 per row."""
    return min(tokens, num_rows(tokens, max_num_seqs) * (num_speculative_tokens + 1))


def build(lay: Layout, sampling_rows: list[tuple[int, int]], size: int,
          idle_slot: int) -> tuple[np.ndarray, list[list[int]]]:
    """points [4, size] int32 (POINT_FIELDS) for `sampling_rows`: (laid-out row, drafts in it)
    per row that samples, in order. Returns them and each row's point indices."""
    points = np.zeros((len(POINT_FIELDS), size), np.int32)  # [4, P]
    points[1] = idle_slot
    at, owned = 0, []
    for row, drafts in sampling_rows:
        n = drafts + 1
        if at + n > size:
            raise ValueError(f"the step's rows need more than {size} sampling points")
        span = slice(at, at + n)
        back = np.arange(-drafts, 1)  # [n]: the row's last n queries
        points[0, span] = lay.logits_index[row] + back
        points[1, span] = lay.row_slot[row]
        points[2, span] = lay.context_lens[row] + back  # the sampled token's position
        points[3, at + n - 1] = 1
        owned.append(list(range(at, at + n)))
        at += n
    return points, owned
