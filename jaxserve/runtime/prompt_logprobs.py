"""Prompt logprobs: the logprob of every prompt token given the tokens before it, computed in
the same ragged step that prefills it (vLLM's `SamplingParams.prompt_logprobs`).

A step with a row that asks for them is its bucket's one more compiled variant: the LM head
runs over all T flat tokens as well as the sampling rows, and for each flat token the program
returns the logprob of its *target* (the next prompt token, given as `targets` [T]; -1: none)
and the top-K. Only steps with such a row pay the [T, V] head; every other step is unchanged.
Logprobs are of the raw logits (as the sampled tokens' are), so a token's entry here equals
what a greedy step would report for it.

The host side maps a row's flat tokens to prompt positions: the token at position p yields
the entry of position p + 1 (while p + 1 is in the prompt), so a chunked prompt gets its
entries chunk by chunk and a recomputed one (after preemption) the same entries again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    target: jax.Array  # [T] f32: log p(targets[t] | tokens up to t); 0 where targets[t] < 0
    top_ids: jax.Array  # [T, K] i32
    top_logprobs: jax.Array  # [T, K] f32


def compute(logits: jax.Array, targets: jax.Array, k: int = MAX_LOGPROBS) -> PromptLogprobs:
    """logits [T, V] (raw, f32), targets [T] int32 (-1: no target)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [T, V]
    target = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]  # [T]
    top_lps, top_ids = jax.lax.top_k(lp, min(k, lp.shape[-1]))  # [T, K] each
    return PromptLogprobs(jnp.where(targets >= 0, target, 0.0), top_ids.astype(jnp.int32),
                          top_lps)


@dataclasses.dataclass(frozen=True)
class Span:
    """A row's flat tokens that have targets: flat [first, first + count) predict the prompt
    tokens at positions [position + 1, position + 1 + count)."""

    seq_id: str
    k: int  # top logprobs asked for
    first: int
    position: int
    count: int


def targets(size: int, rows: list[tuple[str, int, int, int, int, list[int]]]):
    """targets [size] int32 and the Spans of rows (seq id, k, flat index of the row's first
    query, the position of that query, the row's number of queries, the prompt's ids)."""
    out = np.full(size, -1, np.int32)  # [T]
    spans = []
    for seq_id, k, first, start, n, prompt in rows:
        count = min(start + n, len(prompt) - 1) - start  # the last prompt token has no target
        if count <= 0:
            continue
        out[first:first + count] = prompt[start + 1:start + 1 + count]
        spans.append(Span(seq_id, k, first, start, count))
    return out, spans


def entries(result: PromptLogprobs, spans: list[Span], targets_: np.ndarray):
    """seq id -> (first prompt position given, [{target: lp, **top-k}] per position)."""
    target = np.asarray(result.target)
    top_ids, top_lps = np.asarray(result.top_ids), np.asarray(result.top_logprobs)
    out = {}
    for s in spans:
        rows = range(s.first, s.first + s.count)
        out[s.seq_id] = (s.position + 1, [
            {int(targets_[t]): float(target[t]),
             **{int(i): float(v) for i, v in zip(top_ids[t, :s.k], top_lps[t, :s.k])}}
            for t in rows])
    return out
