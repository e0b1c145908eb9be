"""KV-cache events: what the prefix cache gained and lost, for routers outside the process.

KV-aware routers (llm-d's KV-cache indexer, Dynamo's router) keep a per-replica index of the
cached prefix blocks. The block manager appends to a `KVEventLog` when a full block is
registered in the prefix cache (stored: its hash, its parent's, its tokens), when a cached block
is evicted or dropped (removed), and when a reset empties the cache (all cleared); the engine
drains the log after each step and hands the batch to a publisher
(jaxserve/telemetry/kv_event_publisher.py puts it on the wire). Without a log (events off) the
block manager appends nothing. Hashes are the prefix cache's own 32-byte digests; turning them
into a wire format is the publisher's business. Plain Python, no jax.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one prefix, registered in the prefix cache."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None  # the block before the first one; None at a prompt's start
    token_ids: tuple[int, ...]        # the blocks' tokens, block_size per hash, in order
    block_size: int
    lora_id: int | None = None        # the LoRA adapter whose KV the blocks hold (None: base)


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks whose hashes left the prefix cache (evicted for room, or dropped by a reset)."""

    block_hashes: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache holds nothing any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events in the order they happened, until drained. Consecutive removals (an allocation
    evicting several blocks) are merged into one BlockRemoved."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._removed: list[bytes] = []  # removals not yet closed into an event

    def stored(self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int],
               block_size: int, lora_id: int | None = None) -> None:
        self._close_removals()
        self._events.append(BlockStored(tuple(block_hashes), parent, tuple(token_ids),
                                        block_size, lora_id))

    def removed(self, block_hash: bytes) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        self._removed.clear()  # subsumed: nothing is left to remove
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first; the log is empty afterwards."""
        self._close_removals()
        events, self._events = self._events, []
        return events

    def _close_removals(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed)))
            self._removed = []
