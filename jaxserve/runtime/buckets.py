"""Shape buckets: the finite set of input shapes the jitted steps are compiled for.

Every shape the runner can produce comes from these lists, so all programs compile at warm-up
and a steady-state run compiles nothing.
"""

from __future__ import annotations

MIN_PREFILL_TOKENS = 16


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2*start, ...] below `limit`, then `limit` itself (so the largest case fits)."""
    if limit < 1 or start < 1:
        raise ValueError(f"bucket limits must be >= 1, got limit={limit}, start={start}")
    out, n = [], start
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


def pick(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def prefill_token_buckets(max_num_batched_tokens: int) -> list[int]:
    return powers_of_two_up_to(max_num_batched_tokens,
                               min(MIN_PREFILL_TOKENS, max_num_batched_tokens))


def decode_batch_buckets(max_num_seqs: int) -> list[int]:
    """Rows of a decode call: 1, 4, 16, ... up to max_num_seqs.

    A light load should not pay for max_num_seqs rows (the LM head and sampler cost grows with
    rows); powers of 4 keep the number of programs small.
    """
    out, n = [], 1
    while n < max_num_seqs:
        out.append(n)
        n *= 4
    return out + [max_num_seqs]


def decode_block_buckets(max_blocks_per_seq: int) -> list[int]:
    return powers_of_two_up_to(max_blocks_per_seq)


def prefill_block_buckets(token_bucket: int, block_size: int, max_blocks_per_seq: int) -> list[int]:
    """Context widths (in blocks) for a prefill chunk of `token_bucket` tokens.

    Two per chunk size: just wide enough for a chunk that starts at position 0 (the common case:
    a whole prompt), or the full page-table row (a later chunk, or a recompute after preemption).
    A finer ladder would multiply compile time for little gain.
    """
    narrow = min(max_blocks_per_seq, -(-token_bucket // block_size))
    return sorted({narrow, max_blocks_per_seq})


def ragged_block_buckets(rows: int, max_blocks_per_seq: int) -> list[int]:
    """Sizes of the flat list of blocks a decode call of `rows` rows can use (XLA path).

    Powers of two and the midway 1.5x sizes: padding entries cost as much attention work as
    real blocks and attention dominates a long-context decode step, so halving the worst-case
    padding (50% -> 33%, ~25% -> ~12% on average) is worth the few extra programs.
    """
    powers = powers_of_two_up_to(rows * max_blocks_per_seq, rows)
    mids = [n + n // 2 for n in powers[:-1] if n % 2 == 0 and n + n // 2 < powers[-1]]
    return sorted(set(powers + mids))
