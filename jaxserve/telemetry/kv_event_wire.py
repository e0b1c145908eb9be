"""vLLM's KV-cache event wire format: msgspec structs, and the core events turned into them.

Followed: vllm/distributed/kv_events.py. Field names, order and types are those of
vllm-project/vllm@0181ea3173e5 (BlockStored: block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, then defaulted fields); the encoding is that of vLLM up
to v0.23 (e.g. vllm-project/vllm@b4e69e0af33f): `array_like=True`, so the batch is positional,
`[ts, [events...], data_parallel_rank]`, and each event a tagged positional array
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]`). Later vLLM (PR 42892) sends each event as a tagged map instead; llm-d's indexer
and Dynamo's router decode both shapes, older consumers only arrays, and Dynamo requires the
positional batch, so arrays are what every consumer reads. Fields vLLM added after lora_name
(extra_keys, group_idx, ...) default to None and are omitted (omit_defaults), which positional
decoders accept.

Block hashes go out as 64-bit integers, as vLLM sends them by default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, `maybe_convert_block_hash`: the digest's big-endian
value mod 2**64): Dynamo's decoder reads only integers, not bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from jaxserve.core import kv_events as core

# Where the blocks live, in vLLM's words (MEDIUM_GPU): the accelerator's KV cache.
MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; msgspec tags each with its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def wire_hash(digest: bytes) -> int:
    """A 32-byte block digest as vLLM's integer block hash (its low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def wire_event(event: core.KVEvent) -> KVCacheEvent:
    if isinstance(event, core.BlockStored):
        parent = event.parent_block_hash
        return BlockStored([wire_hash(h) for h in event.block_hashes],
                           None if parent is None else wire_hash(parent),
                           list(event.token_ids), event.block_size, lora_id=event.lora_id,
                           medium=MEDIUM, lora_name=None)
    if isinstance(event, core.BlockRemoved):
        return BlockRemoved([wire_hash(h) for h in event.block_hashes], medium=MEDIUM)
    if isinstance(event, core.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(encoder: msgspec.msgpack.Encoder, ts: float, events: list[core.KVEvent],
                 data_parallel_rank: int) -> bytes:
    return encoder.encode(KVEventBatch(ts, [wire_event(e) for e in events], data_parallel_rank))
