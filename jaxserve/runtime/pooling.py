"""Embedding rows in a step: which tokens each pools, and the pooled sums on the device.

An embedding request's chunk is an ordinary row of the step (its KV is written as any prefill's;
its last chunk samples, as every last chunk does). The step's pooled variant also asks the
model for every token's final hidden state after the final norm and sums, per row, the
hidden states of the tokens that row pools: all of the chunk's tokens for "mean", the prompt's
last token for "last". Only these sums come back to the host, [R, D] float32; the host adds up a
prompt's chunks and divides by its length (core/embedding_state.py).

Steps without embedding rows run the plain programs, unchanged: `StepInputs.pool` is None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler import ScheduledSeq


def token_rows(query_start: np.ndarray, logits_index: np.ndarray, num_tokens: int,
               rows: list[tuple[ScheduledSeq, int, str]]) -> tuple[np.ndarray, list]:
    """(pool [T] int32, the (item, row) pairs that pool anything this step).

    pool holds, for each flat token, the row whose sum it joins, and R (no row) elsewhere.
    query_start [R + 1] and logits_index [R]: the step layout's. rows: each embedding item, its
    laid-out row and its pooling ("last" | "mean").
    """
    r = logits_index.shape[0]
    pool = np.full((num_tokens,), r, np.int32)  # [T]
    pooling = []
    for item, row, kind in rows:
        if kind == "mean":
            start = query_start[row]
            pool[start:start + item.num_new_tokens] = row
        elif item.is_last_chunk:  # "last": only the chunk holding the prompt's last token
            pool[logits_index[row]] = row
        else:
            continue
        pooling.append((item, row))
    return pool, pooling


def idle_pool(num_tokens: int, num_rows: int) -> np.ndarray:
    """A pool that pools nothing (templates: warm-up, multi-host followers)."""
    return np.full((num_tokens,), num_rows, np.int32)  # [T]


def pool_rows(hidden: jax.Array, pool: jax.Array, num_rows: int) -> jax.Array:
    """hidden [T, D] (after the final norm), pool [T] int32 (row, or num_rows: none) ->
    [R, D] float32: each row's sum over its tokens, accumulated in float32."""
    sums = jax.ops.segment_sum(hidden.astype(jnp.float32), pool,
                               num_segments=num_rows + 1)  # [R + 1, D]; row R: the unpooled
    return sums[:num_rows]
