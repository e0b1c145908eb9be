"""The layout of one ragged step: every scheduled sequence's tokens on one flat token axis.

A step is one jitted call over `T` flat tokens (a bucket) holding the decode token of every
decoding sequence and the prefill chunks of any number of sequences. Each scheduled sequence is
one *row*; rows are laid out in order on the flat axis:

- rows of more than one query (prefill chunks, k verified tokens) first; for the XLA path
  (`aligned`) each starts at a multiple of QUERY_CHUNK, so it can attend in aligned chunks of
  QUERY_CHUNK queries that each belong to one row (the gap tokens after a row are idle), while
  a kernel reading `query_start` takes them packed, row r owning [query_start[r],
  query_start[r + 1]);
- then rows of one query (decodes, 1-token chunks), packed.

Idle tokens (gaps, the tail) write their K/V into the null block and belong to no row; idle
rows (past the real ones) have no queries. Everything here is numpy: the runner turns it into
device arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxserve.core.sequence import PLACEHOLDER
from jaxserve.runtime import buckets

QUERY_CHUNK = 16
_FAR = np.iinfo(np.int32).max // 2  # a padding pair's first position: never visible


class Row(NamedTuple):
    """One scheduled sequence: `len(tokens)` queries at positions [start, start + len).

    A named tuple (immutable, and built for every row of every step several times faster than
    a frozen dataclass); `build` transposes the decode rows with zip.
    """

    slot: int                # its batch slot: its row of the page table, its sampling state
    start: int               # position of its first query
    tokens: list[int]        # input ids; PLACEHOLDER where the device supplies the id
    samples: bool            # a token is sampled after its last query


class Columns(NamedTuple):
    """Rows of one query each, by columns: what `build` transposes single-query Rows into.
    Given to `build` directly (the decodes of a steady decoding step), every row samples."""

    slots: list[int]
    starts: list[int]
    tokens: list[int]        # each row's one input id (PLACEHOLDER: the device supplies it)


def _span(n: int, aligned: bool) -> int:
    return -(-n // QUERY_CHUNK) * QUERY_CHUNK if aligned and n > 1 else n


def flat_tokens_needed(query_lens: list[int], aligned: bool = True) -> int:
    """Flat tokens the rows take (aligned: with the multi-query rows' alignment gaps)."""
    total = sum(query_lens)  # one query a row, mostly: only the longer rows get gaps
    if aligned:
        total += sum(_span(n, True) - n for n in query_lens if n > 1)
    return total


def max_flat_tokens(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The most flat tokens a step can need: every multi-query row can leave a gap of
    QUERY_CHUNK - 1 tokens, and a step has at most min(seqs, tokens / 2) such rows."""
    rows = min(max_num_seqs, max_num_batched_tokens // 2)
    return max_num_batched_tokens + (QUERY_CHUNK - 1) * rows


# Aligned multi-query rows a step just past the budget usually has (a chunk or two, a few short
# prompts): the bucket above the budget covers their gaps, so such a step is not run at the
# far larger worst-case size.
TYPICAL_GAPS = 4


# Decode steps above this many rows get 3/4 buckets (fine_decode): below it a CPU step's cost is
# mostly fixed (the weights, the LM head's columns), so padding rows is cheap.
FINE_DECODE_ABOVE = 16


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int,
                  aligned: bool = True, fine_decode: bool = False,
                  drafted_row: int = 0) -> list[int]:
    """Flat-axis sizes a step can have: powers of two up to the budget, then (aligned) a bucket
    for a few rows' alignment gaps and the worst-case bound. fine_decode: also 3/4 of each power
    of two between FINE_DECODE_ABOVE and max_num_seqs rows (24, 48, ...), for a backend whose
    step cost grows with its rows (the CPU: linears, LM head and sampler run per row), and,
    packed (not aligned), the `drafted_row` tokens of one speculating sequence's verify row
    (k + 1): batch-1 speculation, its main use, then verifies without padding rows."""
    ladder = buckets.powers_of_two_up_to(max_num_batched_tokens)
    if fine_decode:
        ladder = buckets.three_quarter_points(ladder, FINE_DECODE_ABOVE,
                                              min(max_num_seqs, max_num_batched_tokens))
        if not aligned and 1 < drafted_row < max_num_batched_tokens:
            ladder = sorted(set(ladder) | {drafted_row})
    if not aligned:
        return ladder
    top = max_flat_tokens(max_num_batched_tokens, max_num_seqs)
    typical = min(top, max_num_batched_tokens + QUERY_CHUNK * TYPICAL_GAPS)
    return ladder + sorted({typical, top} - {ladder[-1]})


def num_rows(tokens: int, max_num_seqs: int) -> int:
    """Rows of a step of `tokens` flat tokens (each row has a token): what logits are for."""
    return min(tokens, max_num_seqs)


def pair_tile(rows: int) -> int:
    """Pairs (single query, block) the XLA path attends per loop iteration: few iterations for
    a large batch, little padding for a small one."""
    return int(min(512, max(16, 8 * rows)))


def pair_capacity(rows: int, max_blocks: int) -> int:
    """Size of the flat list of (single query, block) pairs: every row's whole context."""
    tile = pair_tile(rows)
    return -(-rows * max_blocks // tile) * tile


def kv_tile_blocks(block_size: int) -> int:
    """Blocks per key tile of the XLA path's chunked (multi-query) attention: ~64 keys."""
    return max(1, 64 // block_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """The host arrays of one step (see StepInputs in step_call.py for what each becomes)."""

    tokens: np.ndarray        # [T] int32 (0 where PLACEHOLDER)
    feed: np.ndarray          # [T] bool: take the id from the device (the slot's last sample)
    positions: np.ndarray     # [T] int32
    write_slots: np.ndarray   # [T] int32: flat cache slot each token's K/V goes to
    token_slot: np.ndarray    # [T] int32: batch slot of each token's row; idle: the idle slot
    multi: np.ndarray         # [T] bool: the token is in a multi-query row
    query_start: np.ndarray   # [R + 1] int32
    context_lens: np.ndarray  # [R] int32: keys of each row after this step's writes
    logits_index: np.ndarray  # [R] int32: flat index of each row's last query
    row_slot: np.ndarray      # [R] int32
    samples: np.ndarray       # [R] bool
    page_table: np.ndarray | None   # [R, max_blocks] int32 ("page_table" backends)
    pairs: np.ndarray | None        # [3, W] int32 (block, token, first position) (XLA)
    num_pairs: np.ndarray | None    # [] int32
    chunk_pages: np.ndarray | None  # [T / QUERY_CHUNK, Pc] int32: each chunk's row's blocks
    row_index: list[int]      # the row of each input row (multi-query rows are laid out first)


def build(rows: list[Row] | Columns, page_table: np.ndarray, *, tokens: int,
          max_num_seqs: int, block_size: int, idle_slot: int, ragged: bool) -> Layout:
    """Lays `rows` out on `tokens` flat tokens (a bucket >= flat_tokens_needed).

    page_table [slots, max_blocks]: each batch slot's blocks (the runner's host copy).
    ragged: the XLA path's layout (aligned multi-query rows, the pair and chunk lists); else
    packed rows and the page table.
    """
    r, t = num_rows(tokens, max_num_seqs), tokens
    if isinstance(rows, Columns):
        multis, row_index, need = [], range(len(rows.slots)), len(rows.slots)
        singles, samp = rows, True
    else:
        lens = [len(row.tokens) for row in rows]
        need = flat_tokens_needed(lens, ragged)
        multis, single_rows, row_index = _order(rows, lens)
        singles = None
        if single_rows:
            slots, starts, toks, samp = zip(*single_rows)  # Row's fields, transposed
            singles = Columns(slots, starts, [q[0] for q in toks])
    if len(row_index) > r:
        raise ValueError(f"{len(row_index)} rows do not fit a step of {r} rows")
    if need > t:
        raise ValueError(f"the rows need {need} flat tokens, the step has {t}")
    tok = np.zeros((t,), np.int32)  # [T]
    pos = np.zeros((t,), np.int32)
    tslot = np.full((t,), idle_slot, np.int32)
    qstart = np.zeros((r + 1,), np.int32)  # [R + 1]
    ctx = np.zeros((r,), np.int32)  # [R]
    lidx = np.zeros((r,), np.int32)
    rslot = np.full((r,), idle_slot, np.int32)
    samples = np.zeros((r,), bool)
    at = 0
    for i, row in enumerate(multis):  # few: a loop is fine
        n = len(row.tokens)
        span = slice(at, at + n)
        qstart[i], tok[span], tslot[span] = at, row.tokens, row.slot
        pos[span] = np.arange(row.start, row.start + n)
        ctx[i], lidx[i], rslot[i], samples[i] = row.start + n, at + n - 1, row.slot, row.samples
        at += _span(n, ragged)
    multi = np.zeros((t,), bool)
    multi[:at] = True  # gaps too: they are masked by belonging to no row's span
    m, n = len(multis), 0 if singles is None else len(singles.slots)
    if n:  # many (every decode): vectorised
        span, rows_ = slice(at, at + n), slice(m, m + n)
        tok[span] = singles.tokens
        pos[span] = singles.starts
        tslot[span] = rslot[rows_] = singles.slots
        samples[rows_] = samp
        qstart[rows_] = lidx[rows_] = np.arange(at, at + n)
        ctx[rows_] = pos[span] + 1
    qstart[m + n:] = at + n
    write = page_table[tslot, pos // block_size] * block_size + pos % block_size
    write[tslot == idle_slot] = 0  # idle tokens write into the null block
    feed = tok == PLACEHOLDER
    tok[feed] = 0
    table = page_table[rslot]  # [R, max_blocks]; idle rows: the idle slot's zeros
    pairs = num_pairs = chunk_pages = None
    if ragged:
        pairs, num_pairs = _pairs(m, m + n, qstart, ctx, table, block_size, r)
        chunk_pages = _chunk_pages(multis, qstart, table, t, block_size)
    return Layout(tokens=tok, feed=feed, positions=pos, write_slots=write.astype(np.int32),
                  token_slot=tslot, multi=multi, query_start=qstart, context_lens=ctx,
                  logits_index=lidx, row_slot=rslot, samples=samples,
                  page_table=None if ragged else table, pairs=pairs, num_pairs=num_pairs,
                  chunk_pages=chunk_pages, row_index=list(row_index))


def _order(rows: list[Row], lens: list[int]) -> tuple[list[Row], list[Row], list[int]]:
    """(multi-query rows, single-query rows, the laid-out row of each input row): multi-query
    rows first, each group in input order."""
    if lens.count(1) == len(lens):  # decodes only, the steady state: already in order
        return [], rows, list(range(len(rows)))
    multi_ids = [i for i, n in enumerate(lens) if n > 1]
    single_ids = [i for i, n in enumerate(lens) if n == 1]
    row_index = [0] * len(rows)
    for r_, i in enumerate(multi_ids + single_ids):
        row_index[i] = r_
    return [rows[i] for i in multi_ids], [rows[i] for i in single_ids], row_index


def _pairs(first_single, end, qstart, ctx, table, block_size, r):
    """Every block a single-query row's query sees: (block id, flat token, first position)."""
    cap = pair_capacity(r, table.shape[1])
    pairs = np.zeros((3, cap), np.int32)  # [3, W]; padding: block 0, never visible
    pairs[2] = _FAR
    single = np.arange(first_single, end)
    counts = -(-ctx[single] // block_size)  # [n] blocks each single row sees
    total = int(counts.sum())
    if total:
        row_of = np.repeat(single, counts)
        first = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        pairs[0, :total] = table[row_of, first]
        pairs[1, :total] = qstart[row_of]
        pairs[2, :total] = first * block_size
    return pairs, np.int32(total)


def _chunk_pages(multis, qstart, table, t, block_size):
    kt = kv_tile_blocks(block_size)
    max_blocks = table.shape[1]
    pages = np.zeros((t // QUERY_CHUNK, -(-max_blocks // kt) * kt), np.int32)  # [C, Pc]
    for i, row in enumerate(multis):
        first = qstart[i] // QUERY_CHUNK
        pages[first:first + -(-len(row.tokens) // QUERY_CHUNK), :max_blocks] = table[i]
    return pages
