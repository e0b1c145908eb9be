"""Paged KV cache block allocator with reference counts.

Blocks are indices into the KV cache's block axis. Each holds `block_size`
consecutive token positions of one sequence. Reference counts exist so blocks
can be shared (`fork`, later prefix caching); a write into a shared block is
turned into copy-on-write: the writer gets a fresh block and the caller must
copy the KV of `src` into `dst` on device before the step's writes.

Block 0 is the null block when `reserve_null_block` is set: it is never handed
out, so padded page-table entries can point at it without clobbering real KV.

With `enable_caching`, full blocks whose KV is computed are registered by content hash
(prefix_cache.py). `cached_prefix(seq)` finds the blocks a new sequence can reuse and
`allocate(seq, n, cached=...)` attaches them (a shared cached block costs no new block). A
block nobody references keeps its hash and stays reusable until `_take` runs out of uncached
free blocks and evicts the least recently freed one. Cached blocks are immutable: a write into
one (or into any shared block) is a copy-on-write.
"""

from __future__ import annotations

from collections import deque

from jaxserve.core.kv_events import KVEventLog
from jaxserve.core.prefix_cache import PrefixCache, block_hashes
from jaxserve.core.sequence import Sequence

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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserve_null_block: bool = True,
                 enable_caching: bool = False, events: KVEventLog | None = None) -> None:
        """events: where the prefix cache's stored / removed / cleared blocks are logged for
        KV-aware routers (core/kv_events.py); None (the default) logs nothing."""
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
        self.enable_caching = enable_caching
        self.events = events
        self.cache = PrefixCache(events)
        # Counters for stats(): admissions looked up in the cache and what they found.
        self.num_query_blocks = self.num_query_tokens = 0
        self.num_hit_blocks = self.num_hit_tokens = 0
        self.num_cow_copies = 0

    # ---- capacity -------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self._first_usable

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references: uncached ones plus cached ones that can be evicted."""
        return len(self._free) + len(self.cache.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self.cache)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- allocation -----------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s longest computed prefix (for a sequence with no blocks).

        The last token is never taken from the cache: its logits are needed, so at least it is
        computed (a fully cached, block-aligned prompt recomputes its last block, as vLLM does).
        A sequence that asks for prompt logprobs needs the logits of every prompt token, so it
        takes nothing from the cache (as in vLLM); its computed blocks are still registered.
        """
        if (not self.enable_caching or seq.block_table or seq.num_computed_tokens
                or getattr(seq.sampling_params, "prompt_logprobs", None) is not None):
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        return self.cache.lookup(block_hashes(seq, self.block_size)[:limit])

    def _start(self, seq: Sequence, cached) -> int:
        if cached:
            if seq.block_table or seq.num_computed_tokens:
                raise ValueError(f"{seq.request_id!r}: cached blocks are only attached to a "
                                 f"sequence with no blocks")
            return len(cached) * self.block_size
        return seq.num_computed_tokens

    def _num_new_tokens(self, seq: Sequence, num_new_tokens: int | None, start: int) -> int:
        uncomputed = seq.num_tokens - start
        n = uncomputed if num_new_tokens is None else num_new_tokens
        if not 1 <= n <= uncomputed:
            raise ValueError(
                f"{seq.request_id!r}: num_new_tokens must be in [1, {uncomputed}] "
                f"(its uncomputed tokens), got {n}")
        return n

    def _written_blocks_to_copy(self, seq: Sequence, n: int) -> list[int]:
        """Table indices of existing blocks the next `n` writes touch that are shared or cached."""
        first = seq.num_computed_tokens // self.block_size
        last = min((seq.num_computed_tokens + n - 1) // self.block_size, len(seq.block_table) - 1)
        return [i for i in range(first, last + 1)
                if self._ref_counts[seq.block_table[i]] > 1
                or seq.block_table[i] in self.cache.hash_of]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int | None = None,
                      cached: list[int] = ()) -> int:
        """Free blocks used up so the next `num_new_tokens` tokens can be written.

        `cached` (from cached_prefix) are attached first: hits on blocks nobody references
        leave the free pool, hits on blocks in use cost nothing.
        """
        start = self._start(seq, cached)
        n = self._num_new_tokens(seq, num_new_tokens, start)
        target = blocks_for_tokens(start + n, self.block_size)
        if cached:
            revived = sum(1 for b in cached if self._ref_counts[b] == 0)
            return revived + target - len(cached)
        missing = max(0, target - len(seq.block_table))
        return missing + len(self._written_blocks_to_copy(seq, n))

    def fits_in_place(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the next `num_new_tokens` writes land in blocks `seq` already holds alone and
        uncached, so `allocate` would change nothing (most decodes): checked per sequence every
        step, without building the copy list."""
        start, table = seq.num_computed_tokens, seq.block_table
        last = (start + num_new_tokens - 1) // self.block_size
        if last >= len(table):
            return False
        refs, cached = self._ref_counts, self.cache.hash_of
        for block in table[start // self.block_size:last + 1]:
            if refs[block] > 1 or block in cached:
                return False
        return True

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None,
                     cached: list[int] = ()) -> bool:
        return self.blocks_needed(seq, num_new_tokens, cached) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None,
                 cached: list[int] | None = None) -> list[tuple[int, int]]:
        """Make positions [computed, computed + n) writable; n defaults to all uncomputed.

        `cached` is an admission's cache lookup (cached_prefix, possibly empty): its blocks
        become the start of the table, `num_computed_tokens` moves past them, and the lookup is
        counted in the hit statistics; n then counts from there. Returns copy-on-write pairs
        (src, dst) the caller must copy on device before writing this step's KV.
        """
        needed = self.blocks_needed(seq, num_new_tokens, cached or ())
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"{seq.request_id!r} needs {needed} blocks but only {self.num_free_blocks} "
                f"are free; call can_allocate first")
        if cached is not None:
            self._attach_cached(seq, cached)
        n = self._num_new_tokens(seq, num_new_tokens, seq.num_computed_tokens)
        copies = []
        for i in self._written_blocks_to_copy(seq, n):
            src = seq.block_table[i]
            dst = self._take()
            self._release(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        target = blocks_for_tokens(seq.num_computed_tokens + n, self.block_size)
        while len(seq.block_table) < target:
            seq.block_table.append(self._take())
        if seq.block_table:
            self._holders[seq.request_id] = seq
        return copies

    def _attach_cached(self, seq: Sequence, cached: list[int]) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id!r}: a cache lookup is for a sequence being "
                             f"admitted, with no blocks")
        for block in cached:
            if self._ref_counts[block] == 0:
                self.cache.touch(block)
            self._ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.num_registered_blocks = len(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        if self.enable_caching:
            self.num_query_blocks += seq.num_tokens // self.block_size
            self.num_query_tokens += seq.num_tokens
            self.num_hit_blocks += len(cached)
            self.num_hit_tokens += len(cached) * self.block_size

    def register_computed(self, seq: Sequence) -> None:
        """Registers `seq`'s full blocks whose KV is now computed (call after each step)."""
        if not self.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = block_hashes(seq, self.block_size)
        if self.events is not None:
            self._register_logged(seq, hashes, full)
        else:
            for i in range(seq.num_registered_blocks, full):
                self.cache.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = full

    def _register_logged(self, seq: Sequence, hashes: list[bytes], full: int) -> None:
        """register_computed's loop, logging each run of consecutive newly named blocks as one
        stored event. A block whose content another block already holds (a fork's, a repeated
        prompt's) is not news: that hash was stored before."""
        run: list[int] = []
        for i in range(seq.num_registered_blocks, full + 1):
            if i < full and self.cache.register(seq.block_table[i], hashes[i]):
                run.append(i)
            elif run:
                first, bs = run[0], self.block_size
                self.events.stored([hashes[j] for j in run], hashes[first - 1] if first else None,
                                   seq.token_ids_slice(first * bs, (run[-1] + 1) * bs), bs,
                                   seq.lora_id or None)
                run = []

    def _take(self) -> int:
        # Uncached free blocks first; a cached one is evicted only when none is left.
        block = self._free.popleft() if self._free else self.cache.evict()
        self._ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self.cache.hash_of:
                self.cache.park(block)
            else:
                self._free.append(block)

    def reset_prefix_cache(self) -> int:
        """Forgets the cached blocks nobody references (benchmarks repeating a workload want
        cold prefixes); blocks that running sequences hold stay cached. Returns how many."""
        blocks = self.cache.drop_evictable()
        self._free.extend(blocks)
        return len(blocks)

    # ---- release and sharing ---------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody references return to the free list."""
        # Reversed so the tail (least likely shared) is reused, or evicted, first.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        self._holders.pop(seq.request_id, None)

    def truncate(self, seq: Sequence) -> int:
        """Returns the blocks past what `seq`'s tokens need (a speculative row's rejected tail),
        newest first; returns how many were freed. Only uncomputed positions may be cut: the
        registered (cached) blocks hold computed tokens, which truncation never touches."""
        keep = max(blocks_for_tokens(seq.num_tokens, self.block_size),
                   blocks_for_tokens(seq.num_computed_tokens, self.block_size))
        if keep < seq.num_registered_blocks:
            raise InvariantError(f"{seq.request_id!r}: truncating to {keep} blocks would drop "
                                 f"{seq.num_registered_blocks - keep} registered ones")
        cut = seq.block_table[keep:]
        for block in reversed(cut):
            self._release(block)
        del seq.block_table[keep:]
        # Hashes of blocks that held drafts no longer name the sequence's tokens.
        del seq.block_hashes[seq.num_known_tokens // self.block_size:]
        if not seq.block_table:
            self._holders.pop(seq.request_id, None)
        return len(cut)

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
        child.num_registered_blocks = 0
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
        if in_use + self.num_free_blocks != self.num_usable_blocks:
            raise InvariantError(
                f"{in_use} used + {self.num_free_blocks} free != {self.num_usable_blocks} "
                f"usable blocks (a block leaked)")
        self._check_cache(free)

    def _check_cache(self, free: list[int]) -> None:
        cache = self.cache
        if not self.enable_caching and cache.hash_of:
            raise InvariantError("blocks are cached with caching disabled")
        if len(cache.block_of) != len(cache.hash_of) or any(
                cache.block_of.get(h) != b for b, h in cache.hash_of.items()):
            raise InvariantError("the hash -> block and block -> hash maps disagree")
        for block in cache.evictable:
            if block not in cache.hash_of or self._ref_counts[block] != 0:
                raise InvariantError(f"evictable block {block} is uncached or referenced")
        if set(free) & cache.hash_of.keys():
            raise InvariantError("a cached block is on the uncached free list")
        for block in cache.hash_of:
            if self._ref_counts[block] == 0 and block not in cache.evictable:
                raise InvariantError(f"cached block {block} is unreferenced but not evictable")
        # A cached block holds exactly the prefix its hash names, for every holder of it.
        for rid, seq in self._holders.items():
            n = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
            hashes = block_hashes(seq, self.block_size) if self.enable_caching else []
            for i in range(n):
                h = cache.hash_of.get(seq.block_table[i])
                if h is not None and h != hashes[i]:
                    raise InvariantError(f"{rid!r} block {i} is cached under another prefix")
