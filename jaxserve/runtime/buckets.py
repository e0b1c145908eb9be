"""Shape buckets: the finite set of input shapes the jitted steps are compiled for.

Every shape the runner can produce comes from these lists (the step's flat token axis from
step_layout.token_buckets, built on them), so all programs compile at warm-up and a
steady-state run compiles nothing.
"""

from __future__ import annotations


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2*start, ...] below `limit`, then `limit` itself (so the largest case fits)."""
    if limit < 1 or start < 1:
        raise ValueError(f"bucket limits must be >= 1, got limit={limit}, start={start}")
    out, n = [], start
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


def three_quarter_points(ladder: list[int], above: int, up_to: int) -> list[int]:
    """`ladder` (powers of two) with 3/4 of each power of two in (above, up_to] added: a step
    whose cost grows with its rows then pads to under 1.5x its size there, not up to 2x."""
    extra = {3 * n // 4 for n in ladder if n % 4 == 0 and above < 3 * n // 4 <= up_to}
    return sorted(set(ladder) | extra)


def pick(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def slot_write_buckets(max_num_seqs: int) -> list[int]:
    """Sequences one slot-state delta writes: 1, 4, 16, ... up to max_num_seqs.

    Most steps admit one or a few sequences; powers of 4 keep the number of programs small.
    """
    out, n = [], 1
    while n < max_num_seqs:
        out.append(n)
        n *= 4
    return out + [max_num_seqs]
