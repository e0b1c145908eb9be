"""KV memory accounting: what the paged cache holds, what it wastes, and what a contiguous
cache would have wasted on the same requests. Plain Python; reads only public state (each
sequence's block table and computed-token count, the block manager's used-block count).

Per request, after a step: `blocks` = len(block table), `reserved` = blocks * block_size slots,
`tokens` = tokens whose KV is written (num_computed_tokens), `wasted` = reserved - tokens: the
unused slots of its tail block. The block manager allocates blocks only for tokens being
written, so 0 <= wasted <= block_size - 1, and wasted == 0 exactly when tokens is a multiple of
block_size (tested).

Totals count a block shared by several requests (fork, prefix caching) once; its filled slots
are those of the holder that has written furthest into it.

Baselines (earlier systems, e.g. FasterTransformer and Orca in the vLLM paper, section 3):
a contiguous cache reserves each request's whole possible length up front, either
`max_model_len` or `prompt + max_tokens`; its waste is everything reserved but not yet stored
(reservation plus internal fragmentation). External fragmentation is not modelled, so these
baselines understate what those systems lost.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Protocol


class _Seq(Protocol):
    request_id: str
    block_table: list[int]
    num_computed_tokens: int
    prompt_token_ids: list[int]
    sampling_params: Any  # .max_tokens


@dataclasses.dataclass(frozen=True)
class RequestMemory:
    request_id: str
    blocks: int
    tokens: int
    reserved: int  # slots: blocks * block_size
    wasted: int    # reserved - tokens: the tail block's unused slots

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    block_size: int
    capacity_slots: int           # usable blocks * block_size
    requests: tuple[RequestMemory, ...]
    blocks_used: int              # unique blocks held by requests (a shared block once)
    tokens: int                   # unique token slots holding KV
    reserved: int                 # blocks_used * block_size
    contiguous_max_len_reserved: int   # each request reserving max_model_len
    contiguous_request_reserved: int   # each request reserving prompt + max_tokens
    num_requests: int | None = None   # len(requests) when they are listed (see totals())

    def __post_init__(self):
        if self.num_requests is None:
            object.__setattr__(self, "num_requests", len(self.requests))

    @property
    def wasted(self) -> int:
        return self.reserved - self.tokens

    @property
    def waste_fraction(self) -> float:
        """Of the slots requests hold, the fraction not holding KV."""
        return self.wasted / self.reserved if self.reserved else 0.0

    @property
    def utilisation(self) -> float:
        """Tokens stored / the cache's capacity."""
        return self.tokens / self.capacity_slots if self.capacity_slots else 0.0

    def to_dict(self, per_request: bool = False) -> dict:
        out = {"block_size": self.block_size, "capacity_slots": self.capacity_slots,
               "num_requests": self.num_requests, "blocks_used": self.blocks_used,
               "tokens": self.tokens, "reserved": self.reserved, "wasted": self.wasted,
               "waste_fraction": self.waste_fraction, "utilisation": self.utilisation,
               "contiguous_max_len_reserved": self.contiguous_max_len_reserved,
               "contiguous_max_len_waste_fraction": _waste(self.tokens,
                                                           self.contiguous_max_len_reserved),
               "contiguous_request_reserved": self.contiguous_request_reserved,
               "contiguous_request_waste_fraction": _waste(self.tokens,
                                                           self.contiguous_request_reserved)}
        if per_request:
            out["requests"] = [r.to_dict() for r in self.requests]
        return out


def _waste(tokens: int, reserved: int) -> float:
    return 1.0 - tokens / reserved if reserved else 0.0


def request_memory(seq: _Seq, block_size: int) -> RequestMemory:
    blocks = len(seq.block_table)
    reserved = blocks * block_size
    return RequestMemory(seq.request_id, blocks, seq.num_computed_tokens, reserved,
                         reserved - seq.num_computed_tokens)


def _unique_tokens(seqs: list[_Seq], block_size: int) -> tuple[int, int]:
    """(unique blocks, their filled slots) when some blocks appear in several tables."""
    filled: dict[int, int] = {}
    for seq in seqs:
        for i, block in enumerate(seq.block_table):
            n = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            filled[block] = max(filled.get(block, 0), n)
    return len(filled), sum(filled.values())


def snapshot(seqs: Iterable[_Seq], *, block_size: int, num_usable_blocks: int,
             max_model_len: int, num_used_blocks: int | None = None) -> MemorySnapshot:
    """Accounts the KV memory of `seqs` (those holding blocks: the scheduler's running list).

    `num_used_blocks` (the block manager's count) lets the common unshared case skip the
    per-block walk: when the tables' entries add up to it, no block appears twice.
    """
    seqs = [s for s in seqs if s.block_table]
    total = totals(seqs, block_size=block_size, num_usable_blocks=num_usable_blocks,
                   max_model_len=max_model_len,
                   num_used_blocks=-1 if num_used_blocks is None else num_used_blocks)
    return dataclasses.replace(total, requests=tuple(request_memory(s, block_size)
                                                     for s in seqs))


def totals(seqs: list[_Seq], *, block_size: int, num_usable_blocks: int,
           max_model_len: int, num_used_blocks: int) -> MemorySnapshot:
    """snapshot()'s totals without the per-request list (`requests` is empty): what the engine
    records every step, in one pass over the sequences. num_used_blocks: as for snapshot (-1:
    always walk the blocks)."""
    n = entries = tokens = contiguous = 0
    for s in seqs:  # every running sequence, every step: plain attribute reads
        blocks = len(s.block_table)
        if blocks:
            n += 1
            entries += blocks
            tokens += s.num_computed_tokens
            contiguous += len(s.prompt_token_ids) + s.sampling_params.max_tokens
    if entries != num_used_blocks:  # a block in several tables: count it once
        held = [s for s in seqs if s.block_table]
        entries, tokens = _unique_tokens(held, block_size)
    return MemorySnapshot(
        block_size=block_size, capacity_slots=num_usable_blocks * block_size, requests=(),
        blocks_used=entries, tokens=tokens, reserved=entries * block_size,
        contiguous_max_len_reserved=n * max_model_len, contiguous_request_reserved=contiguous,
        num_requests=n)


class MemoryTracker:
    """Time averages over steps (each step weighs the same), as the vLLM paper's figure 2."""

    def __init__(self):
        self.num_steps = 0
        self.sums = dict.fromkeys(("tokens", "reserved", "contiguous_max_len_reserved",
                                   "contiguous_request_reserved"), 0)
        self.peak_requests = 0
        self.peak_blocks_used = 0
        self.peak_tokens = 0

    def observe(self, snap: MemorySnapshot) -> None:
        self.num_steps += 1
        for key in self.sums:
            self.sums[key] += getattr(snap, key)
        self.peak_requests = max(self.peak_requests, snap.num_requests)
        self.peak_blocks_used = max(self.peak_blocks_used, snap.blocks_used)
        self.peak_tokens = max(self.peak_tokens, snap.tokens)

    def to_dict(self) -> dict:
        s, n = self.sums, max(1, self.num_steps)
        return {"num_steps": self.num_steps, "mean_tokens": s["tokens"] / n,
                "mean_reserved": s["reserved"] / n, "peak_requests": self.peak_requests,
                "peak_blocks_used": self.peak_blocks_used, "peak_tokens": self.peak_tokens,
                "paged_waste_fraction": _waste(s["tokens"], s["reserved"]),
                "contiguous_max_len_waste_fraction": _waste(
                    s["tokens"], s["contiguous_max_len_reserved"]),
                "contiguous_request_waste_fraction": _waste(
                    s["tokens"], s["contiguous_request_reserved"])}
