"""Paged KV cache block allocator with reference counts.

Blocks are indices into the KV cache's block axis. Each holds `block_size`
consecutive token positions of one sequence. Reference counts exist so blocks
can be shared (`fork`, later prefix caching); a write into a shared block is
turned into copy-on-write: the writer gets a fresh block and the caller must
copy the KV of `src` into `dst` on device before the step's writes.

Block 0 is the null block when `reserve_null_block` is set: it is never handed
out, so padded page-table entries can point at it without clobbering real KV.
"""

from __future__ import annotations

from collections import deque

from jaxserve.sequence import Sequence

NULL_BLOCK = 0
MAX_BLOCK_SIZE = 256


class InvariantError(RuntimeError):
    """The block manager's bookkeeping is inconsistent (a bug, not bad input)."""


def validate_block_size(block_size: int) -> None:
    if (not isinstance(block_size, int) or block_size < 1 or block_size > MAX_BLOCK_SIZE
            or block_size & (block_size - 1)):
        raise ValueError(
            f"block_size must be a power of 2 between 1 and {MAX_BLOCK_SIZE} "
            f"(e.g. 16), got {block_size!r}")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions: ceil(n / block_size)."""
    return -(-num_tokens // block_size)


def slot_for_position(block_table: list[int], position: int, block_size: int) -> int:
    """Flat KV-cache slot of token `position` for a sequence with `block_table`."""
    return block_table[position // block_size] * block_size + position % block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserve_null_block: bool = True) -> None:
        validate_block_size(block_size)
        first = 1 if reserve_null_block else 0
        if not isinstance(num_blocks, int) or num_blocks <= first:
            raise ValueError(
                f"num_blocks must be at least {first + 1} (block 0 is reserved as the null "
                f"block: {reserve_null_block}), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserve_null_block = reserve_null_block
        self._first_usable = first
        self._free: deque[int] = deque(range(first, num_blocks))
        self._ref_counts = [0] * num_blocks
        # Sequences currently holding blocks, so invariants can be checked
        # against their tables without the caller listing them.
        self._holders: dict[str, Sequence] = {}

    # ---- capacity -------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self._first_usable

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- allocation -----------------------------------------------------

    def _num_new_tokens(self, seq: Sequence, num_new_tokens: int | None) -> int:
        uncomputed = seq.num_uncomputed_tokens
        n = uncomputed if num_new_tokens is None else num_new_tokens
        if not 1 <= n <= uncomputed:
            raise ValueError(
                f"{seq.request_id!r}: num_new_tokens must be in [1, {uncomputed}] "
                f"(its uncomputed tokens), got {n}")
        return n

    def _shared_written_blocks(self, seq: Sequence, n: int) -> list[int]:
        """Table indices of existing blocks the next `n` writes touch that are shared."""
        first = seq.num_computed_tokens // self.block_size
        last = min((seq.num_computed_tokens + n - 1) // self.block_size, len(seq.block_table) - 1)
        return [i for i in range(first, last + 1) if self._ref_counts[seq.block_table[i]] > 1]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int | None = None) -> int:
        """Fresh blocks needed so the next `num_new_tokens` tokens can be written."""
        n = self._num_new_tokens(seq, num_new_tokens)
        target = blocks_for_tokens(seq.num_computed_tokens + n, self.block_size)
        missing = max(0, target - len(seq.block_table))
        return missing + len(self._shared_written_blocks(seq, n))

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> list[tuple[int, int]]:
        """Make positions [computed, computed + n) writable; n defaults to all uncomputed.

        Returns copy-on-write pairs (src, dst) the caller must copy on device
        before writing this step's KV.
        """
        n = self._num_new_tokens(seq, num_new_tokens)
        needed = self.blocks_needed(seq, n)
        if needed > len(self._free):
            raise RuntimeError(
                f"{seq.request_id!r} needs {needed} blocks but only {len(self._free)} are "
                f"free; call can_allocate first")
        copies = []
        for i in self._shared_written_blocks(seq, n):
            src = seq.block_table[i]
            dst = self._take()
            self._ref_counts[src] -= 1
            seq.block_table[i] = dst
            copies.append((src, dst))
        target = blocks_for_tokens(seq.num_computed_tokens + n, self.block_size)
        while len(seq.block_table) < target:
            seq.block_table.append(self._take())
        if seq.block_table:
            self._holders[seq.request_id] = seq
        return copies

    def can_append_slot(self, seq: Sequence) -> bool:
        self._require_decode(seq)
        return self.can_allocate(seq, 1)

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Slot for a decode step's one new token: a new block only at a boundary.

        Returns the (src, dst) copy pair if the tail block was shared.
        """
        self._require_decode(seq)
        copies = self.allocate(seq, 1)
        return copies[0] if copies else None

    @staticmethod
    def _require_decode(seq: Sequence) -> None:
        if seq.num_uncomputed_tokens != 1:
            raise ValueError(
                f"{seq.request_id!r} has {seq.num_uncomputed_tokens} uncomputed tokens; "
                f"append_slot is for decode (exactly 1), use allocate for prefill")

    def _take(self) -> int:
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    # ---- release and sharing ---------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody references return to the free list."""
        # Reversed so the tail (least likely shared) is reused last.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table.clear()
        self._holders.pop(seq.request_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of `parent`'s blocks with `child` (copy-on-write on later writes).

        Only the blocks are shared; the caller gives `child` the same tokens and
        `num_computed_tokens` as the parent.
        """
        if child.block_table:
            raise ValueError(f"fork target {child.request_id!r} already holds blocks")
        if child.request_id in self._holders:
            raise ValueError(f"request id {child.request_id!r} already holds blocks")
        for block in parent.block_table:
            self._ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        if child.block_table:
            self._holders[child.request_id] = child

    # ---- checking -------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise InvariantError if refcounts, free list and block tables disagree."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise InvariantError("a block is on the free list twice")
        expected = [0] * self.num_blocks
        for rid, seq in self._holders.items():
            if seq.request_id != rid:
                raise InvariantError(f"holder {rid!r} renamed to {seq.request_id!r}")
            if not seq.block_table:
                raise InvariantError(f"{rid!r} is registered but holds no blocks")
            covered = len(seq.block_table) * self.block_size
            if seq.num_computed_tokens > covered:
                raise InvariantError(
                    f"{rid!r} has {seq.num_computed_tokens} computed tokens but blocks "
                    f"for only {covered}")
            for block in seq.block_table:
                if not self._first_usable <= block < self.num_blocks:
                    raise InvariantError(f"{rid!r} holds invalid block {block}")
                expected[block] += 1
        for block, (ref, want) in enumerate(zip(self._ref_counts, expected)):
            if ref < 0:
                raise InvariantError(f"block {block} has negative refcount {ref}")
            if ref != want:
                raise InvariantError(
                    f"block {block} has refcount {ref} but {want} table entries")
        for block in free:
            if block < self._first_usable:
                raise InvariantError(f"null block {block} is on the free list")
            if self._ref_counts[block] != 0:
                raise InvariantError(f"block {block} is free but referenced")
        in_use = sum(1 for b in range(self._first_usable, self.num_blocks) if self._ref_counts[b])
        if in_use + len(free) != self.num_usable_blocks:
            raise InvariantError(
                f"{in_use} used + {len(free)} free != {self.num_usable_blocks} usable blocks "
                f"(a block leaked)")
