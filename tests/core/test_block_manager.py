"""Block manager: allocation arithmetic, refcounts, copy-on-write, invariants."""

import math
from types import SimpleNamespace

import pytest

from jaxserve.core.block_manager import (
    NULL_BLOCK, BlockManager, InvariantError, blocks_for_tokens)
from jaxserve.core.sequence import Sequence

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def make_seq(rid="r", n_prompt=1, max_tokens=8):
    return Sequence(rid, list(range(100, 100 + n_prompt)), SimpleNamespace(max_tokens=max_tokens))


def compute_all(seq):
    """Pretend the model ran every uncomputed token."""
    seq.num_computed_tokens = seq.num_tokens


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 15, 16, 17, 255, 256, 257, 1000])
def test_allocate_counts(block_size, n_tokens):
    bm = BlockManager(num_blocks=1 + 1000, block_size=block_size)
    seq = make_seq(n_prompt=n_tokens)
    expected = math.ceil(n_tokens / block_size)
    assert blocks_for_tokens(n_tokens, block_size) == expected
    assert bm.blocks_needed(seq) == expected
    assert bm.can_allocate(seq)
    assert bm.allocate(seq) == []
    assert len(seq.block_table) == expected
    assert len(set(seq.block_table)) == expected
    assert NULL_BLOCK not in seq.block_table
    assert bm.num_used_blocks == expected
    assert bm.num_free_blocks == 1000 - expected
    bm.check_invariants()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chunked_allocation_grows_incrementally(block_size):
    n_prompt = 600
    bm = BlockManager(num_blocks=1 + math.ceil(n_prompt / block_size), block_size=block_size)
    seq = make_seq(n_prompt=n_prompt)
    chunk = 37
    while seq.num_uncomputed_tokens:
        n = min(chunk, seq.num_uncomputed_tokens)
        bm.allocate(seq, n)
        # Exactly enough blocks for what will have been written, not the whole prompt.
        assert len(seq.block_table) == math.ceil((seq.num_computed_tokens + n) / block_size)
        seq.num_computed_tokens += n
        bm.check_invariants()
    assert bm.num_free_blocks == 0


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_allocates_only_at_boundaries(block_size):
    bm = BlockManager(num_blocks=1 + 605, block_size=block_size)
    seq = make_seq(n_prompt=5)
    bm.allocate(seq)
    compute_all(seq)
    new_block_at = []
    for step in range(600):
        seq.append_token(step)
        before = len(seq.block_table)
        assert bm.can_allocate(seq, 1)
        assert bm.allocate(seq, 1) == []
        if len(seq.block_table) != before:
            assert len(seq.block_table) == before + 1
            new_block_at.append(seq.num_tokens - 1)  # position being written
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == math.ceil(seq.num_tokens / block_size)
    # New blocks exactly when the written position starts a block (the prompt
    # covered positions 0..4).
    expected = [p for p in range(5, 605) if p % block_size == 0]
    assert new_block_at == expected
    bm.check_invariants()


def test_allocate_refuses_more_than_uncomputed():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(n_prompt=3)
    with pytest.raises(ValueError, match="uncomputed"):
        bm.allocate(seq, 4)


def test_free_returns_everything():
    bm = BlockManager(num_blocks=33, block_size=4)
    seqs = [make_seq(f"s{i}", n_prompt=7 + i) for i in range(5)]
    for s in seqs:
        bm.allocate(s)
    assert bm.num_used_blocks == sum(math.ceil((7 + i) / 4) for i in range(5))
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
        bm.check_invariants()
    assert bm.num_free_blocks == 32 and bm.num_used_blocks == 0


def test_null_block_never_handed_out():
    bm = BlockManager(num_blocks=10, block_size=1)
    seq = make_seq(n_prompt=9)
    bm.allocate(seq)
    assert sorted(seq.block_table) == list(range(1, 10))
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(make_seq("x"))


def test_without_null_block_all_blocks_usable():
    bm = BlockManager(num_blocks=4, block_size=2, reserve_null_block=False)
    seq = make_seq(n_prompt=8)
    bm.allocate(seq)
    assert sorted(seq.block_table) == [0, 1, 2, 3]
    bm.check_invariants()


def test_exhaustion():
    bm = BlockManager(num_blocks=1 + 4, block_size=16)
    a = make_seq("a", n_prompt=48)
    bm.allocate(a)
    b = make_seq("b", n_prompt=17)
    assert bm.blocks_needed(b) == 2
    assert not bm.can_allocate(b)
    assert bm.can_allocate(b, 16)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(b)
    assert b.block_table == [] and bm.num_free_blocks == 1  # failed allocate changed nothing
    bm.allocate(b, 16)
    b.num_computed_tokens = 16
    assert not bm.can_allocate(b)
    bm.free(a)
    assert bm.can_allocate(b)


def test_fork_shares_and_refcounts():
    bm = BlockManager(num_blocks=1 + 8, block_size=4)
    parent = make_seq("p", n_prompt=10)
    bm.allocate(parent)
    compute_all(parent)
    child = make_seq("c", n_prompt=10)
    compute_all(child)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.ref_count(b) for b in parent.block_table] == [2, 2, 2]
    assert bm.num_used_blocks == 3
    bm.check_invariants()
    bm.free(parent)
    assert [bm.ref_count(b) for b in child.block_table] == [1, 1, 1]
    assert bm.num_used_blocks == 3  # still held by the child
    bm.free(child)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_copy_on_write_partial_shared_tail():
    bm = BlockManager(num_blocks=1 + 8, block_size=4)
    parent = make_seq("p", n_prompt=10)  # blocks: [0..3] [4..7] [8,9,_,_]
    bm.allocate(parent)
    compute_all(parent)
    child = make_seq("c", n_prompt=10)
    compute_all(child)
    bm.fork(parent, child)
    shared_tail = parent.block_table[2]

    child.append_token(1)
    assert bm.blocks_needed(child, 1) == 1
    [(src, dst)] = bm.allocate(child, 1)
    assert src == shared_tail and dst not in parent.block_table and dst != NULL_BLOCK
    assert child.block_table == parent.block_table[:2] + [dst]
    assert bm.ref_count(shared_tail) == 1 and bm.ref_count(dst) == 1
    assert [bm.ref_count(b) for b in parent.block_table[:2]] == [2, 2]
    bm.check_invariants()

    # The parent is now the sole owner of its tail: no copy.
    parent.append_token(2)
    assert bm.allocate(parent, 1) == []
    assert parent.block_table[2] == shared_tail


def test_no_copy_when_shared_tail_is_full():
    bm = BlockManager(num_blocks=1 + 8, block_size=4)
    parent = make_seq("p", n_prompt=8)
    bm.allocate(parent)
    compute_all(parent)
    child = make_seq("c", n_prompt=8)
    compute_all(child)
    bm.fork(parent, child)
    child.append_token(1)  # position 8 starts a fresh block
    assert bm.allocate(child, 1) == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3
    bm.check_invariants()


def test_cow_counts_against_capacity():
    bm = BlockManager(num_blocks=1 + 3, block_size=4)
    parent = make_seq("p", n_prompt=10)
    bm.allocate(parent)
    compute_all(parent)
    child = make_seq("c", n_prompt=10)
    compute_all(child)
    bm.fork(parent, child)
    child.append_token(1)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(child, 1)


def test_fork_rejects_target_with_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq("a", 3), make_seq("b", 3)
    bm.allocate(a)
    bm.allocate(b)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.fork(a, b)


@pytest.mark.parametrize("corrupt, message", [
    (lambda bm, s: s.block_table.append(s.block_table[0]), "refcount"),
    (lambda bm, s: bm._free.append(s.block_table[0]), "free but referenced"),
    (lambda bm, s: s.block_table.append(NULL_BLOCK), "invalid block 0"),
    (lambda bm, s: bm._free.popleft(), "leaked"),
    (lambda bm, s: bm._free.append(bm._free[0]), "twice"),
    (lambda bm, s: setattr(s, "num_computed_tokens", 99), "computed tokens"),
    (lambda bm, s: s.block_table.clear(), "holds no blocks"),
])
def test_invariant_checker_catches_corruption(corrupt, message):
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(n_prompt=9)
    bm.allocate(seq)
    bm.check_invariants()
    corrupt(bm, seq)
    with pytest.raises(InvariantError, match=message):
        bm.check_invariants()


def test_negative_refcount_detected():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm._ref_counts[5] = -1
    with pytest.raises(InvariantError, match="negative"):
        bm.check_invariants()


@pytest.mark.parametrize("bad", [0, 3, 12, 512, -2, 1.0, "16"])
def test_bad_block_size_rejected(bad):
    with pytest.raises(ValueError, match="power of 2 between 1 and 256"):
        BlockManager(num_blocks=8, block_size=bad)


@pytest.mark.parametrize("bad", [0, 1, -1])
def test_too_few_blocks_rejected(bad):
    with pytest.raises(ValueError, match="num_blocks must be at least 2"):
        BlockManager(num_blocks=bad, block_size=4)



def _computed(bm, rid, n_prompt, allocate=None):
    seq = make_seq(rid, n_prompt=n_prompt)
    bm.allocate(seq, allocate)
    compute_all(seq)
    return seq


def _decode_inside_block(bm):
    seq = _computed(bm, "mid", 6)  # the 7th token is written into block 1
    seq.append_token(1)
    return seq, 1


def _decode_at_boundary(bm):
    seq = _computed(bm, "full", 8)  # position 8 starts a new block
    seq.append_token(1)
    return seq, 1


def _decode_into_shared_tail(bm):
    parent = _computed(bm, "p", 10)
    child = make_seq("c", n_prompt=10)
    compute_all(child)
    bm.fork(parent, child)
    child.append_token(1)
    return child, 1


def _write_into_cached_block(bm):
    seq = _computed(bm, "o", 8)
    bm.register_computed(seq)  # both full blocks cached, held by seq alone
    seq.num_computed_tokens = 7  # recompute the last prompt token (as a fork child does)
    return seq, 1


def _chunk(n):
    def case(bm):
        seq = make_seq("chunk", n_prompt=12)
        bm.allocate(seq, 4)  # blocks for positions 0..3
        seq.num_computed_tokens = 2
        return seq, n
    return case


@pytest.mark.parametrize("case, fits", [
    (_decode_inside_block, True), (_decode_at_boundary, False),
    (_decode_into_shared_tail, False), (_write_into_cached_block, False),
    (_chunk(2), True), (_chunk(6), False)],
    ids=["inside-block", "boundary", "shared-tail", "cached", "chunk-inside", "chunk-past"])
def test_fits_in_place_is_exactly_allocate_doing_nothing(case, fits):
    """The scheduler's decode fast path skips allocate when fits_in_place: it must hold exactly
    when allocate would take no block and copy nothing."""
    bm = BlockManager(num_blocks=1 + 16, block_size=4, enable_caching=True)
    seq, n = case(bm)
    assert bm.fits_in_place(seq, n) == fits
    table, free = list(seq.block_table), bm.num_free_blocks
    copies = bm.allocate(seq, n)
    assert fits == (copies == [] and seq.block_table == table and bm.num_free_blocks == free)
    bm.check_invariants()
