"""The runner's device calls as pytrees: a step's packed inputs (`StepInputs`) and the three
kinds of call (`StepCall`, `SlotsCall` in slot_state.py, `CopyCall`), plus `Pending`, a launched
step's handle. Multi-host followers receive these calls as they are (multihost.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from jaxserve.runtime.prompt_logprobs import Span
from jaxserve.runtime.sampler import SamplerOutput

# Rows of StepInputs.per_token and per_row. Few arrays, not one per field: each host array a
# call takes is a separate transfer with a fixed cost that dominates arrays this small.
TOKEN_FIELDS = ("tokens", "feed", "positions", "write_slots", "token_slot", "multi")
ROW_FIELDS = ("query_start", "context_lens", "logits_index", "row_slot", "samples", "scalars")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One ragged step's inputs (step_layout.Layout), packed.

    per_token [6, T] int32: TOKEN_FIELDS (tokens are 0 where fed from the device; feed: take the
    slot's last sampled id; token_slot: the idle slot for idle tokens; multi: XLA layout only).
    per_row [6, R + 1] int32: ROW_FIELDS; query_start uses R + 1 entries, the others R; scalars
    holds num_pairs and want_logprobs. pages: the page table [R, max_blocks] ("page_table"
    backends) or the chunk pages [T / 16, Pc] (XLA); pairs [3, W] (XLA) or None. mask
    [R, ceil(V / 32)] int32: the rows' packed bitmasks of allowed tokens, all ones for rows
    without a constraint; None when no row has one (a program without the masking). points
    [4, P] int32: a verification step's sampling points (spec_points.py), None in a plain step.
    poison [R] (or [P] with points) float32: added to each row's logits before sampling (fault injection,
    jaxserve/faults.py: NaN or inf on a poisoned row, 0 elsewhere); None in every program of
    an engine without that fault, so normal programs are unchanged.
    pool [T] int32: the row whose embedding sum each token joins (R: none; runtime/pooling.py),
    in a step with embedding rows; None in every other step (the plain programs).
    prompt_targets [T] int32: each flat token's next prompt token whose logprob a row asked for
    (-1: none; prompt_logprobs.py), None in a step without such a row.
    """

    per_token: jax.Array
    per_row: jax.Array
    pages: jax.Array
    pairs: jax.Array | None = None
    mask: jax.Array | None = None
    poison: jax.Array | None = None
    points: jax.Array | None = None
    pool: jax.Array | None = None
    prompt_targets: jax.Array | None = None

    def field(self, name: str) -> jax.Array:
        if name in TOKEN_FIELDS:
            return self.per_token[TOKEN_FIELDS.index(name)]
        r = self.per_row.shape[1] - 1
        row = self.per_row[ROW_FIELDS.index(name)]
        # query_start has R + 1 entries; scalars two, which need not fit R (a 1-row step).
        return row if name in ("query_start", "scalars") else row[:r]

    def meta(self, ragged: bool) -> PagedMeta:
        """The attention backends' view (positions and slots as [1, T])."""
        f, scalars = self.field, self.per_row[ROW_FIELDS.index("scalars")]
        r = self.per_row.shape[1] - 1
        return PagedMeta(positions=f("positions")[None], slots=f("write_slots")[None],
                         query_start=f("query_start"), context_lens=f("context_lens"),
                         page_table=jnp.zeros((r, 1), jnp.int32) if ragged else self.pages,
                         pairs=self.pairs, num_pairs=scalars[0] if ragged else None,
                         multi=(f("multi") != 0) if ragged else None,
                         chunk_pages=self.pages if ragged else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepCall:
    """One model step: its inputs, padded to the step's token bucket."""

    inputs: StepInputs

    @property
    def shape(self) -> tuple[int]:
        """(flat tokens,): with `masked`, what `ModelRunner.step_template` rebuilds it from."""
        return (self.inputs.per_token.shape[1],)

    @property
    def masked(self) -> bool:
        """Whether it carries token bitmasks (the step's other compiled variant)."""
        return self.inputs.mask is not None

    @property
    def verifies(self) -> bool:
        """Whether it samples at verification points (speculative decoding's variant)."""
        return self.inputs.points is not None

    @property
    def pools(self) -> bool:
        """Whether it also returns embedding rows' pooled hidden states (runtime/pooling.py)."""
        return self.inputs.pool is not None

    @property
    def scores_prompt(self) -> bool:
        """Whether it also returns prompt logprobs (prompt_logprobs.py's variant)."""
        return self.inputs.prompt_targets is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CopyCall:
    """A batch of block copies: pairs [C, 2] int32 (src, dst), padded with (0, 0)."""

    pairs: jax.Array

    @property
    def shape(self) -> tuple[int]:
        return (self.pairs.shape[0],)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRACall:
    """One adapter written into a device slot (models/lora.py write_slot): slot [] int32,
    weights {module: (A [L, K, R], B [L, R, N])} float32 for every adapted module (zeros for
    those the adapter leaves alone), so every load is the same program."""

    slot: jax.Array
    weights: dict

    @property
    def shape(self) -> tuple[int, ...]:
        return ()


def copy_blocks(cache: KVCache, pairs: jax.Array) -> KVCache:
    """pairs [C, 2] int32 (src, dst). A dst is never another pair's src: dst blocks are fresh."""
    src, dst = pairs[:, 0], pairs[:, 1]
    # Every leaf (K, V and an int8 cache's scales) has the block axis second.
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), cache)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A launched step: which items sample, their rows, and the device's (future) output."""

    items: list[ScheduledSeq]
    rows: list[int]
    sampled: SamplerOutput
    want_logprobs: bool
    # A verification step: each item's sampling points (rows then index points); the items
    # with drafts get a tuple of results from collect.
    points: list[list[int]] | None = None
    drafted: frozenset[str] = frozenset()
    # Embedding rows that pooled tokens: (item, row); their sums are `sampled.pooled`.
    pooling: list[tuple[ScheduledSeq, int]] = dataclasses.field(default_factory=list)
    # A prompt-logprobs step: the rows' spans and the targets; the values are `sampled.prompt`.
    prompt_spans: list[Span] = dataclasses.field(default_factory=list)
    prompt_targets: np.ndarray | None = None
