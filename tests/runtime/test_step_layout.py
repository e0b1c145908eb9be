"""The ragged step's host layout (jaxserve/runtime/step_layout.py) and its token buckets,
checked against what each row asks for, independently recomputed here."""

import dataclasses
import itertools

import numpy as np
import pytest

from jaxserve.core.sequence import PLACEHOLDER
from jaxserve.runtime import buckets, step_layout
from jaxserve.runtime.step_layout import QUERY_CHUNK, Row


@pytest.mark.parametrize("fine", [False, True])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("budget,seqs", [(512, 64), (32, 4), (16, 16), (2048, 256)])
def test_every_schedulable_step_fits_a_bucket(budget, seqs, aligned, fine):
    """Any rows a scheduler can emit (<= seqs rows, <= budget tokens) fit the largest bucket,
    and the worst case (every multi-query row leaving a gap) is exactly the bound."""
    ladder = step_layout.token_buckets(budget, seqs, aligned, fine)
    assert ladder == sorted(set(ladder)) and ladder[0] == 1
    multi_rows = min(seqs, budget // 2)
    worst = ([2] * multi_rows + [1] * min(seqs - multi_rows, budget - 2 * multi_rows)
             if aligned else [budget])  # packed: tokens are the budget's, whatever the rows
    need = step_layout.flat_tokens_needed(worst, aligned)
    assert buckets.pick(ladder, need) == ladder[-1]
    assert ladder[-1] == (step_layout.max_flat_tokens(budget, seqs) if aligned else budget)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_rows = int(rng.integers(1, seqs + 1))
        lens = rng.multinomial(budget - n_rows, np.ones(n_rows) / n_rows) + 1
        buckets.pick(ladder, step_layout.flat_tokens_needed(lens.tolist(), aligned))  # fits


@pytest.mark.parametrize("budget,seqs,extra", [
    (512, 64, [24, 48]),        # the throughput benchmark's engine
    (2048, 256, [24, 48, 96, 192]),
    (64, 256, [24, 48]),        # rows are capped by the token budget too
    (512, 16, []),              # no decode step above 16 rows
])
def test_fine_decode_buckets_add_three_quarter_points(budget, seqs, extra):
    """fine_decode adds 3/4 of each power of two in (16, min(seqs, budget)], nothing else, and a
    decode step of n > 16 rows then pads to under 1.5 n, not up to 2 n (48 rows run at 48)."""
    for aligned in (True, False):
        plain = step_layout.token_buckets(budget, seqs, aligned)
        fine = step_layout.token_buckets(budget, seqs, aligned, fine_decode=True)
        assert sorted(set(fine) - set(plain)) == extra and set(plain) <= set(fine)
        for rows in range(17, min(seqs, budget) + 1):
            assert buckets.pick(fine, rows) < 1.5 * rows
    if extra:
        assert buckets.pick(step_layout.token_buckets(budget, seqs, True, True), 48) == 48


def test_a_batch1_verify_row_gets_its_own_bucket_on_the_packed_cpu_layout():
    """One speculating sequence's verify row (k + 1 tokens) runs unpadded where the step's cost
    grows with its rows (fine_decode) and rows are packed; nothing changes elsewhere."""
    for k in (2, 4, 8, 12):
        packed = step_layout.token_buckets(256, 1, False, fine_decode=True, drafted_row=k + 1)
        assert buckets.pick(packed, k + 1) == k + 1
        assert set(packed) - {k + 1} == set(step_layout.token_buckets(256, 1, False, True))
        for aligned, fine in ((True, True), (False, False)):  # the XLA layout; GPU
            assert step_layout.token_buckets(256, 1, aligned, fine, drafted_row=k + 1) == \
                step_layout.token_buckets(256, 1, aligned, fine)
    assert step_layout.token_buckets(8, 1, False, True, drafted_row=9) == \
        step_layout.token_buckets(8, 1, False, True)  # past the budget: never scheduled whole


def test_a_step_just_over_the_budget_is_not_run_at_the_worst_case():
    # 63 decodes and a 449-token chunk: 527 aligned tokens.
    need = step_layout.flat_tokens_needed([1] * 63 + [449])
    assert need == 63 + 464
    assert buckets.pick(step_layout.token_buckets(512, 64), need) == 512 + 4 * QUERY_CHUNK


def layout_case(aligned):
    bs, max_blocks, slots = 4, 8, 6
    table = np.zeros((slots + 1, max_blocks), np.int32)
    for s in range(slots):
        table[s] = 1 + s * max_blocks + np.arange(max_blocks)
    rows = [Row(slot=3, start=9, tokens=[PLACEHOLDER], samples=True),   # async decode
            Row(slot=0, start=0, tokens=list(range(10, 27)), samples=False),  # 17, mid-prompt
            Row(slot=5, start=2, tokens=[7], samples=True),             # decode
            Row(slot=1, start=6, tokens=[4, 5, 6], samples=True)]        # k = 3 queries
    need = step_layout.flat_tokens_needed([len(r.tokens) for r in rows], aligned)
    lay = step_layout.build(rows, table, tokens=need + 3, max_num_seqs=slots, block_size=bs,
                            idle_slot=slots, ragged=aligned)
    return rows, table, lay, bs


@pytest.mark.parametrize("aligned", [True, False])
def test_layout_places_each_row_where_its_metadata_says(aligned):
    rows, table, lay, bs = layout_case(aligned)
    r = len(lay.context_lens)
    assert r == 6 and sorted(lay.row_index) == [0, 1, 2, 3]
    spans = []
    for row, i in zip(rows, lay.row_index):
        a, n = lay.query_start[i], len(row.tokens)
        if aligned and n > 1:
            assert a % QUERY_CHUNK == 0
        else:
            assert lay.query_start[i + 1] == a + n  # packed
        span = slice(a, a + n)
        spans.append(span)
        want_tokens = [0 if t == PLACEHOLDER else t for t in row.tokens]
        assert lay.tokens[span].tolist() == want_tokens
        assert lay.feed[span].tolist() == [t == PLACEHOLDER for t in row.tokens]
        pos = np.arange(row.start, row.start + n)
        assert lay.positions[span].tolist() == pos.tolist()
        assert lay.write_slots[span].tolist() == (table[row.slot, pos // bs] * bs
                                                  + pos % bs).tolist()
        assert (lay.token_slot[span] == row.slot).all()
        assert lay.context_lens[i] == row.start + n and lay.row_slot[i] == row.slot
        assert lay.logits_index[i] == a + n - 1 and lay.samples[i] == row.samples
    owned = np.zeros(len(lay.tokens), bool)
    for span in spans:
        owned[span] = True
    # Everything else is idle: the idle slot, the null block, no feed.
    assert (lay.token_slot[~owned] == 6).all() and (lay.write_slots[~owned] == 0).all()
    assert not lay.feed[~owned].any()
    assert (lay.row_slot[4:] == 6).all() and (lay.context_lens[4:] == 0).all()
    assert (np.diff(lay.query_start) >= 0).all()
    if not aligned:
        assert lay.pairs is None and (lay.page_table[:4] == table[lay.row_slot[:4]]).all()
        assert (lay.page_table[4:] == 0).all()


def test_pairs_and_chunks_cover_exactly_what_each_query_sees():
    rows, table, lay, bs = layout_case(True)
    n = int(lay.num_pairs)
    got = {(int(b), int(t), int(s)) for b, t, s in lay.pairs[:, :n].T}
    want = set()
    for row, i in zip(rows, lay.row_index):
        if len(row.tokens) == 1:
            t = lay.query_start[i]
            want |= {(int(table[row.slot, j]), int(t), j * bs)
                     for j in range(-(-(row.start + 1) // bs))}
    assert got == want and n == len(want)
    assert (lay.pairs[2, n:] > 10 ** 8).all()  # padding pairs are never visible
    assert lay.pairs.shape[1] % step_layout.pair_tile(len(lay.context_lens)) == 0
    for row, i in zip(rows, lay.row_index):
        if len(row.tokens) > 1:
            first = lay.query_start[i] // QUERY_CHUNK
            for c in range(first, first + -(-len(row.tokens) // QUERY_CHUNK)):
                assert (lay.chunk_pages[c, :table.shape[1]] == table[row.slot]).all()
            assert lay.multi[lay.query_start[i]:lay.query_start[i] + len(row.tokens)].all()
    singles = [lay.query_start[i] for row, i in zip(rows, lay.row_index) if len(row.tokens) == 1]
    assert not lay.multi[singles].any()


def test_too_many_rows_or_tokens_are_refused():
    table = np.zeros((3, 4), np.int32)
    rows = [Row(slot=s, start=0, tokens=[1], samples=True) for s in range(3)]
    with pytest.raises(ValueError, match="3 rows do not fit a step of 2 rows"):
        step_layout.build(rows, table, tokens=2, max_num_seqs=2, block_size=4, idle_slot=2,
                          ragged=True)
    with pytest.raises(ValueError, match="need 17 flat tokens"):
        step_layout.build([Row(slot=0, start=0, tokens=[1] * 17, samples=True)], table,
                          tokens=16, max_num_seqs=2, block_size=4, idle_slot=2, ragged=False)


@pytest.mark.parametrize("aligned", [True, False])
def test_decode_columns_lay_out_as_their_rows(aligned):
    """Steady decoding hands `build` its single-query rows by columns (the runner's
    _decode_rows): the layout is the one of the same rows given as Rows (checked above)."""
    rng = np.random.default_rng(3)
    bs, slots = 4, 9
    table = rng.integers(1, 50, (slots + 1, 6)).astype(np.int32)
    table[slots] = 0  # the idle slot's row
    order = rng.permutation(slots)[:7].tolist()
    starts = rng.integers(0, 6 * bs, 7).tolist()
    tokens = [PLACEHOLDER if k % 3 else int(rng.integers(1, 99)) for k in range(7)]
    rows = [Row(slot=s, start=p, tokens=[t], samples=True)
            for s, p, t in zip(order, starts, tokens)]
    kw = dict(tokens=8, max_num_seqs=8, block_size=bs, idle_slot=slots, ragged=aligned)
    want = step_layout.build(rows, table, **kw)
    got = step_layout.build(step_layout.Columns(order, starts, tokens), table, **kw)
    for field in dataclasses.fields(want):
        a, b = getattr(want, field.name), getattr(got, field.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), field.name
        else:
            assert a == b, field.name
