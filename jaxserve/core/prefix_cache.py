"""Automatic prefix caching: content hashes of full KV blocks and the LRU of cached free blocks.

A full block is named by sha256(parent block's hash, its token ids, an extra key such as a
per-request cache salt), so equal hashes mean equal prefixes up to and including the block
(a collision needs a sha256 collision; Python's `hash` would make one easy to hit). The block
manager registers a block once its KV is computed; a later sequence whose prefix hashes match
reuses it instead of recomputing. Freed blocks keep their hash and wait in `evictable`, least
recently freed first; they are evicted (their hash dropped) only when no uncached free block is
left. Plain Python, no jax.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from jaxserve.core.kv_events import KVEventLog
from jaxserve.core.sequence import Sequence


def hash_block(parent: bytes, token_ids, extra: bytes = b"") -> bytes:
    """sha256 over (parent hash, token ids as little-endian int64, extra key), 32 bytes."""
    h = hashlib.sha256()
    h.update(len(parent).to_bytes(1, "little"))
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    h.update(extra)
    return h.digest()


def block_hashes(seq: Sequence, block_size: int) -> list[bytes]:
    """Hashes of `seq`'s full blocks (prompt + output), extended incrementally and kept on it.

    Tokens are only ever appended, so earlier hashes stay valid (also across preemption). A
    block holding a PLACEHOLDER (an id still on the device) is not hashed yet.
    """
    hashes = seq.block_hashes
    full = seq.num_known_tokens // block_size
    if len(hashes) < full:
        extra = seq.cache_salt.encode("utf-8") if seq.cache_salt else b""
        if seq.lora_id:  # an adapter's KV differs from the base model's for the same tokens
            extra += b"\x00lora:%d" % seq.lora_id
        tokens = seq.token_ids_slice(len(hashes) * block_size, full * block_size)
        parent = hashes[-1] if hashes else b""
        for i in range(0, len(tokens), block_size):
            parent = hash_block(parent, tokens[i:i + block_size], extra)
            hashes.append(parent)
    return hashes[:full]


class PrefixCache:
    """hash <-> block maps plus the LRU order of cached blocks nobody references.

    events: where hashes leaving the cache are logged (kv_events.py); None: not logged.
    """

    def __init__(self, events: KVEventLog | None = None) -> None:
        self.events = events
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        # Cached blocks with refcount 0, oldest first: what eviction takes.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self.hash_of)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`."""
        blocks = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, h: bytes) -> bool:
        """Names `block` by `h` unless another block already holds that content (or `block` is
        named already); returns whether it did."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h] = block
        self.hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """`block` (cached) lost its last reference: it becomes the most recent evictable."""
        self.evictable[block] = None

    def touch(self, block: int) -> None:
        """A hit on a cached block: it is referenced again, so it is no longer evictable."""
        self.evictable.pop(block, None)

    def drop_evictable(self) -> list[int]:
        """Forgets every cached block nobody references; returns them (now uncached)."""
        blocks = list(self.evictable)
        dropped = [self.hash_of.pop(block) for block in blocks]
        for h in dropped:
            del self.block_of[h]
        self.evictable.clear()
        if self.events is not None and dropped:
            if self.hash_of:  # blocks running requests hold stay cached: name what left
                for h in dropped:
                    self.events.removed(h)
            else:
                self.events.cleared()
        return blocks

    def evict(self) -> int:
        """Drops the least recently freed cached block from the cache and returns it."""
        block, _ = self.evictable.popitem(last=False)
        h = self.hash_of.pop(block)
        del self.block_of[h]
        self.num_evictions += 1
        if self.events is not None:
            self.events.removed(h)
        return block
