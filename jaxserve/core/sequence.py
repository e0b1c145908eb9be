"""Per-request bookkeeping for the paged KV engine.

A `Sequence` is the scheduler's view of one request: its tokens, how many of
them already have KV in the cache, and which cache blocks hold that KV.

Token accounting (the contract the scheduler, block manager and runner share):

* `all_token_ids` = prompt + generated tokens; `num_tokens` is its length.
* `num_computed_tokens` tokens (a prefix) have their KV written to the cache.
* The remaining `num_uncomputed_tokens` still have to be run through the model.
  Token `p` lives at position `p` and its KV goes to slot
  `block_table[p // block_size] * block_size + p % block_size`.
* A sequence is in *prefill* while more than one token is uncomputed. In
  *decode* exactly one token is uncomputed: the last sampled one, whose KV is
  written in the same step that samples the next token.
* With asynchronous scheduling the last token may be `PLACEHOLDER`: sampled by a
  step still running on the device, whose id the host learns one step later
  (the next step takes it from the device; see Scheduler.commit).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any


PLACEHOLDER = -1  # a sampled token id the host does not know yet


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Preempted by recompute: back in the waiting queue with no blocks.
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    # Failed inside a step (a bug or an unchecked limit): ended so the engine can go on.
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        # A tuple, compared by identity: hashing an enum member (a set lookup) runs Python
        # code, and this is read for every sequence several times a step.
        return self in _FINISHED


_FINISHED = (
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
)


class Sequence:
    """One request. `sampling_params` is opaque except for `max_tokens`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        *,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        output_token_ids: Iterable[int] = (),
        priority: int = 0,
        lora_id: int = 0,
        prompt_only: bool = False,
        skip_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self.priority = priority  # lower is admitted first and preempted last
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        # Non-empty for a fork that continues another sequence's output (a beam's child).
        self.output_token_ids: list[int] = list(output_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        # Prefix caching: an extra key mixed into every block hash (requests with different
        # salts never share blocks), the hashes of full blocks so far (see prefix_cache.py), and
        # how many leading blocks of block_table the block manager has registered in the cache.
        self.cache_salt = cache_salt
        # The LoRA adapter's lora_int_id (0: the base model): its rows run with that adapter,
        # and its blocks are cached apart from every other adapter's.
        self.lora_id = lora_id
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        # Batch slots this sequence holds in the scheduler: a request that will fork into k
        # branches (n > 1, beam search) reserves k from admission, and each fork moves one to
        # the child, so forking never overflows max_num_seqs.
        self.num_reserved_slots = 1
        # An embedding request's sequence (core/embedding_state.py): it runs its prompt, and
        # its one sampled token only ends it (never run), so the prompt alone must fit
        # max_model_len.
        self.prompt_only = prompt_only
        # Admitted without a prefix-cache lookup (its blocks are still cached for others): it
        # needs every prompt position computed (mean pooling, prompt logprobs), which a hit
        # would skip.
        self.skip_prefix_cache = skip_prefix_cache

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def ends_in_placeholder(self) -> bool:
        """Whether the last token is a committed step's PLACEHOLDER (its id not known yet)."""
        out = self.output_token_ids
        return bool(out) and out[-1] == PLACEHOLDER

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but a trailing PLACEHOLDER."""
        return self.num_tokens - self.ends_in_placeholder

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) without building the full list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:  # a decode: no copy of the whole sequence
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.all_token_ids[start:stop]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the cache, keep every token.

        The caller must already have returned the blocks to the block manager;
        the next prefill then covers prompt + output so far, so nothing that was
        generated is lost and the next sampled token continues the sequence.
        """
        if self.block_table:
            raise RuntimeError(
                f"{self.request_id!r}: free its blocks before reset_for_recompute")
        self.num_computed_tokens = 0
        self.status = SequenceStatus.PREEMPTED
