"""KV blocks a sliding window has left behind (plain Python, no jax).

When every layer attends through a window of at most W positions (Mistral; not Gemma, whose
global layers read the whole context), a sequence whose next query sits at position n never
reads keys before n - W + 1 again: its leading blocks wholly before that point are dead. They
stay allocated (prefix caching may hand them to another request, whose own queries need
them), so this only counts them, for stats(); freeing them is left to a later change.
"""

from __future__ import annotations

from typing import Iterable

from jaxserve.core.sequence import Sequence


def slid_past_blocks(num_computed_tokens: int, block_size: int, window: int | None) -> int:
    """Leading blocks no future query of any layer can see (0 without a model-wide window)."""
    if window is None:
        return 0
    first_needed = max(0, num_computed_tokens - window + 1)  # the next query's first key
    return first_needed // block_size


def total_slid_past(seqs: Iterable[Sequence], block_size: int, window: int | None) -> int:
    return sum(slid_past_blocks(s.num_computed_tokens, block_size, window) for s in seqs)
