"""On-device token sampler, run inside the jitted prefill/decode step.

Per slot, in vLLM's order: repetition/frequency/presence penalties -> min_tokens ban of stop ids
-> greedy argmax (temperature 0) or temperature -> top-k -> top-p -> min-p -> random draw.
Logprobs are of the raw logits (vLLM's default), not of the processed distribution.

Shapes are fixed (S = max_num_seqs slots, V = vocab) and every knob is a traced value, so one
compile serves all batches. The costly parts (penalties, filtering, the draw, top logprobs) sit
under `lax.cond`, so batches that do not use them skip them. With `branch_free` (the GPU step)
every part runs and selects replace the conds: XLA:GPU runs a conditional by copying its
predicate to the host and waiting for it, which stalls the host mid-step; the tokens are the
same either way. The GPU step itself (backend "pallas") runs the branch-free sampler's
filters, draw and top logprobs in one Pallas kernel: jaxserve/runtime/sampler_kernel.py.

Batch independence: a slot's token depends only on its own row, seed and position. Filters
become a per-row logit cutoff and the draw is always made in vocab order, so a slot gets the
same token whichever branches other slots force. The draw is an inverse CDF with one float32
uniform per slot (tokens below ~1e-7 probability are resolved only coarsely), which avoids
generating S*V random numbers per step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.core.sampling_params import (MAX_LOGPROBS, MAX_STOP_IDS, SamplingParams,
                                           min_tokens_banned_ids)

# MAX_STOP_IDS (core/sampling_params.py) is the width of the per-slot table of ids banned while
# num_generated < min_tokens; tiny next to [S, V]. The engine refuses requests needing more.
# vLLM's epsilon: below it logits / T overflows float32, and the result is argmax anyway.
GREEDY_EPS = 1e-5
# Filtering looks at each row's top TOP_CANDIDATES logits first (lax.top_k is ~40x cheaper than
# a full sort on CPU); typical top_k (<= 128) and peaked top_p rows never need more.
TOP_CANDIDATES = 128
_BLOCK = 256  # the draw's first level picks one of ceil(V / _BLOCK) blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-slot sampling knobs; every field is [S] except stop_ids [S, MAX_STOP_IDS]."""

    temperature: jax.Array  # f32; < GREEDY_EPS means greedy
    top_k: jax.Array  # i32; <= 0 or >= V means off
    top_p: jax.Array  # f32; 1 means off
    min_p: jax.Array  # f32; 0 means off
    repetition_penalty: jax.Array  # f32; 1 means off
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    seed: jax.Array  # u32
    min_tokens: jax.Array  # i32
    num_generated: jax.Array  # i32; output tokens so far, compared with min_tokens
    stop_ids: jax.Array  # i32 [S, MAX_STOP_IDS]; -1 padded

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams | None], seeds: Sequence[int | None],
                    num_generated: Sequence[int], eos_ids: Sequence[int] = (), *,
                    size: int) -> SamplingTensors:
        """Host (numpy) tensors for `size` slots; slot i uses params[i], None/missing = idle.

        seeds[i] is the engine's seed for the request (the request's own seed, or a random one
        the engine drew). eos_ids are the model's end ids, banned together with the request's
        stop_token_ids while fewer than min_tokens have been generated (unless ignore_eos).
        """
        if len(params) > size:
            raise ValueError(f"{len(params)} requests for {size} sampler slots")
        t = _idle_tensors(size)
        for i, p in enumerate(params):
            if p is None:
                continue
            for name in _COPIED:  # ints clamped: top_k / min_tokens may exceed int32
                t[name][i] = min(getattr(p, name), _I32_MAX)
            seed = seeds[i] if seeds[i] is not None else p.seed
            if seed is None and not p.greedy:
                raise ValueError(f"slot {i} has no seed; the engine must assign one")
            t["seed"][i] = seed_to_u32(seed or 0)
            t["num_generated"][i] = num_generated[i]
            if p.min_tokens > 0:
                t["stop_ids"][i] = _banned_row(p, eos_ids)
        return cls(**t)


_COPIED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "min_tokens")
_I32_MAX = 2 ** 31 - 1


def _idle_tensors(size: int) -> dict[str, np.ndarray]:
    # Idle slots are greedy with every filter and penalty off, so they never trigger a cond.
    def full(value, dtype):
        return np.full((size,), value, dtype)  # [S]

    return dict(
        temperature=full(0.0, np.float32), top_k=full(0, np.int32), top_p=full(1.0, np.float32),
        min_p=full(0.0, np.float32), repetition_penalty=full(1.0, np.float32),
        presence_penalty=full(0.0, np.float32), frequency_penalty=full(0.0, np.float32),
        seed=full(0, np.uint32), min_tokens=full(0, np.int32), num_generated=full(0, np.int32),
        stop_ids=np.full((size, MAX_STOP_IDS), -1, np.int32),  # [S, MAX_STOP_IDS]
    )


def _banned_row(p: SamplingParams, eos_ids: Sequence[int]) -> np.ndarray:
    ids = min_tokens_banned_ids(p, eos_ids)  # raises past MAX_STOP_IDS
    row = np.full((MAX_STOP_IDS,), -1, np.int32)  # [MAX_STOP_IDS]
    row[:len(ids)] = ids
    return row


def seed_to_u32(seed: int) -> int:
    """Fold a 64-bit seed into the 32 bits a PRNG key takes, keeping the high word's entropy."""
    s = seed & 0xFFFF_FFFF_FFFF_FFFF
    return (s ^ (s >> 32)) & 0xFFFF_FFFF


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [S] i32
    logprob: jax.Array  # [S] f32, of the sampled token under the raw logits
    top_ids: jax.Array  # [S, K] i32, K = min(max_logprobs, V); zeros when not wanted
    top_logprobs: jax.Array  # [S, K] f32; zeros when logprobs were not wanted
    # Not the sampler's: the step's other result for the host, the embedding rows' pooled sums
    # [R, D] f32 (runtime/pooling.py), set by a pooled step; None in every other step.
    pooled: jax.Array | None = None
    # Likewise the prompt-logprobs variant's PromptLogprobs (runtime/prompt_logprobs.py).
    prompt: Any = None


def sample(logits: jax.Array, st: SamplingTensors, history: jax.Array, context_lens: jax.Array,
           prompt_lens: jax.Array, positions: jax.Array, want_logprobs: jax.Array | bool = True,
           *, max_logprobs: int = MAX_LOGPROBS, top_candidates: int = TOP_CANDIDATES,
           mask: jax.Array | None = None, branch_free: bool = False,
           backend: str = "xla") -> SamplerOutput:
    """Pick one token per slot. logits [S, V]; history [S, L] ids (valid below context_lens
    [S], prompt below prompt_lens [S]); positions [S] = position of the token being sampled.
    mask [S, ceil(V / 32)] int32: a packed bitmask of allowed tokens (bit t % 32 of word
    t // 32), applied before everything else; None (a separate program) allows all.
    backend "pallas" / "pallas-interpret" (branch_free only): the GPU step's kernel sampler
    (jaxserve/runtime/sampler_kernel.py), compiled or interpreted.
    max_logprobs, top_candidates, branch_free and backend are static (mark them static when
    jitting)."""
    if backend != "xla":
        from jaxserve.runtime import sampler_kernel  # it imports this module
        if backend not in sampler_kernel.KERNEL_BACKENDS or not branch_free:
            raise ValueError(f"sampler backend must be 'xla', or one of "
                             f"{sampler_kernel.KERNEL_BACKENDS} with branch_free=True; got "
                             f"{backend!r} with branch_free={branch_free}")
        return sampler_kernel.sample(logits, st, history, context_lens, prompt_lens, positions,
                                     want_logprobs, max_logprobs=max_logprobs, mask=mask,
                                     interpret=backend == "pallas-interpret")
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [S]
    raw, logits = logits, apply_token_bitmask(logits, mask)  # logprobs stay those of raw
    choose = functools.partial(_choose, st, positions, top_candidates, branch_free)
    if branch_free:  # neutral penalties and inactive bans leave a row's logits unchanged
        tokens = choose(ban_stop_ids(apply_penalties(logits, st, history, context_lens,
                                                      prompt_lens), st))
    else:
        adjust = jnp.any((st.repetition_penalty != 1.0) | (st.presence_penalty != 0.0)
                         | (st.frequency_penalty != 0.0) | (st.num_generated < st.min_tokens))
        # Branches return only [S] tokens: on XLA:CPU an [S, V] cond result costs ~10 ms at
        # S=64, V=49152 (more than the whole greedy path), so the choice runs inside each.
        tokens = lax.cond(adjust,
                          lambda x: choose(ban_stop_ids(
                              apply_penalties(x, st, history, context_lens, prompt_lens), st)),
                          choose, logits)
    logprob = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - lse  # [S]
    k = min(max_logprobs, logits.shape[-1])
    top_ids, top_lps = _branch(branch_free, jnp.asarray(want_logprobs, bool),
                               lambda: _top_logprobs(raw, lse, k),
                               lambda: _no_logprobs(logits.shape[0], k))
    return SamplerOutput(tokens=tokens, logprob=logprob, top_ids=top_ids, top_logprobs=top_lps)


def apply_token_bitmask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """logits [S, V] with the tokens whose bit is 0 in mask [S, W] (W = ceil(V / 32)) at -inf.
    Unpacked with shifts against an iota, so it fuses into the logits' consumers."""
    if mask is None:
        return logits
    s, v = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(s, -1)[:, :v] != 0  # [S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def _branch(branch_free: bool, pred, true_fn, false_fn, *operands):
    """`lax.cond`, or (branch_free) both branches and a select: the same values either way."""
    if not branch_free:
        return lax.cond(pred, true_fn, false_fn, *operands)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(*operands),
                        false_fn(*operands))


def _choose(st, positions, top_candidates, branch_free, x):
    """Tokens [S] from processed logits x [S, V]: argmax for greedy rows, a draw for the rest."""
    greedy = st.temperature < GREEDY_EPS  # [S]
    tokens = _argmax(x)  # [S]
    drawn = _branch(branch_free, jnp.any(~greedy),
                    functools.partial(_sample_random, top_candidates, branch_free),
                    lambda x, st, pos: tokens, x, st, positions)
    return jnp.where(greedy, tokens, drawn)


def apply_penalties(x, st, history, context_lens, prompt_lens):
    """Penalised logits [S, V] as vLLM defines them: repetition over prompt+output (divide
    positive, multiply negative logits); frequency (per occurrence) and presence (once)
    subtracted over output tokens only. Rows with neutral penalties come back unchanged."""
    s, v = x.shape
    pos = jnp.arange(history.shape[1])[None, :]  # [1, L]
    valid = (pos < context_lens[:, None]) & (history >= 0) & (history < v)  # [S, L]
    is_prompt = pos < prompt_lens[:, None]
    # One scatter fills both tables: columns [0, V) count output ids, [V, 2V) count prompt ids;
    # index 2V (garbage beyond context_len) is dropped.
    col = jnp.where(valid, history + jnp.where(is_prompt, v, 0), 2 * v)  # [S, L]
    rows = jnp.arange(s)[:, None]
    counts = jnp.zeros((s, 2 * v), jnp.int32).at[rows, col].add(1, mode="drop")  # [S, 2V]
    out_counts, in_prompt = counts[:, :v], counts[:, v:] > 0  # [S, V] each
    rep = st.repetition_penalty[:, None]
    x = jnp.where(in_prompt | (out_counts > 0), jnp.where(x > 0, x / rep, x * rep), x)
    x = x - st.frequency_penalty[:, None] * out_counts.astype(jnp.float32)
    return x - st.presence_penalty[:, None] * (out_counts > 0).astype(jnp.float32)


def ban_stop_ids(x, st):
    """x [S, V] with each slot's stop ids at -inf while it is under its min_tokens."""
    # Compared against an iota rather than scattered: the compare fuses into the consumers,
    # a scatter materialises a copy of x (~10 ms on CPU at S=64, V=49152).
    v = x.shape[-1]
    active = (st.num_generated < st.min_tokens)[:, None, None]  # [S, 1, 1]
    hit = active & (st.stop_ids[:, :, None] == jnp.arange(v, dtype=jnp.int32))  # [S, M, V]
    return jnp.where(jnp.any(hit, axis=1), -jnp.inf, x)


def _filters_on(st, v):
    return (((st.top_k > 0) & (st.top_k < v)) | (st.top_p < 1.0) | (st.min_p > 0.0)) \
        & (st.temperature >= GREEDY_EPS)


def _sample_random(top_candidates, branch_free, x, st, positions):
    v = x.shape[-1]
    temp = jnp.where(st.temperature < GREEDY_EPS, 1.0, st.temperature)  # greedy rows: unused
    scaled = x / temp[:, None]  # [S, V]
    cutoff = _branch(branch_free, jnp.any(_filters_on(st, v)),
                     functools.partial(_filter_cutoff, top_candidates, branch_free),
                     lambda scaled, st: jnp.full(scaled.shape[:1], -jnp.inf), scaled, st)  # [S]
    u = jax.vmap(uniform)(st.seed, positions)  # [S]
    return _inverse_cdf(scaled, cutoff, u)


def uniform(seed, position):
    """The slot's uniform in [0, 1) for the draw at `position`."""
    # Keyed by (seed, position) only, so the draw never depends on the batch or on the step.
    key = jax.random.fold_in(jax.random.key(seed), position)
    return jax.random.uniform(key, (), jnp.float32)


def _filter_cutoff(top_candidates, branch_free, scaled, st):
    """Smallest kept logit per row after top-k, top-p (on the top-k renormalised probs) and
    min-p. Each filter keeps a prefix of the descending order, so one cutoff captures all three
    (ties at the cutoff are all kept). No [S, V] sort (~0.5 s on CPU at S=64, V=49152): rows are
    resolved from their top `top_candidates` logits, and rows whose cutoff lies deeper (top_k
    above it, or top_p mass not reached within it) by an exact bisection. Which path a row takes
    depends only on that row, so the result never depends on the batch."""
    v = scaled.shape[-1]
    c = min(top_candidates, v)
    top = jnp.max(scaled, axis=-1, keepdims=True)  # [S, 1]
    k = jnp.where((st.top_k <= 0) | (st.top_k > v), v, st.top_k)[:, None]  # [S, 1]
    desc = lax.top_k(scaled, c)[0]  # [S, C]
    ratio = jnp.exp(desc - top)  # p / p_max
    k_in = k <= c
    full_z = jnp.sum(jnp.exp(scaled - top), axis=-1, keepdims=True)
    w = jnp.where(jnp.arange(c) < k, ratio, 0.0)  # [S, C]
    probs = w / jnp.where(k_in, jnp.sum(w, axis=-1, keepdims=True), full_z)
    top_p = st.top_p[:, None]
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each rank
    keep = (w > 0) & ((before < top_p) | (top_p >= 1.0))
    n = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    kp = jnp.where(~k_in & (top_p >= 1.0), -jnp.inf, jnp.take_along_axis(desc, n - 1, axis=-1))
    resolved = (k_in | (top_p >= 1.0) | (jnp.sum(probs, axis=-1, keepdims=True) >= top_p)) \
        & (k_in | (k == v)) | ~_filters_on(st, v)[:, None]  # [S, 1]; greedy rows never go deep

    def deep():  # resolved rows pass k = V so they do not force the top-k bisection
        return jnp.where(resolved, kp, _bisect_cutoff(scaled, jnp.where(resolved, v, k), top_p,
                                                      top, branch_free))

    kp = _branch(branch_free, jnp.all(resolved), lambda: kp, deep)
    return jnp.maximum(kp, top + jnp.log(st.min_p)[:, None])[:, 0]


def _bisect_cutoff(scaled, k, top_p, top, branch_free=False):
    """Exact top-k then top-p cutoff [S, 1] by bisection on the floats' order keys."""
    keys = _order_key(scaled)  # [S, V] u32, same order as the floats
    k_key = _branch(branch_free, jnp.any(k < scaled.shape[-1]),  # top_p-only rows: half the work
                    lambda: _bisect(keys, lambda t: jnp.sum(keys >= t, -1, keepdims=True) >= k,
                                    branch_free),
                    lambda: jnp.zeros_like(keys[:, :1]))
    w = jnp.where(keys >= k_key, jnp.exp(scaled - top), 0.0)  # [S, V] top-k probs * Z
    need = top_p * jnp.sum(w, axis=-1, keepdims=True)
    p_key = _bisect(keys, lambda t: jnp.sum(jnp.where(keys >= t, w, 0.0), -1, keepdims=True)
                    >= need, branch_free)
    p_key = jnp.where(top_p >= 1.0, 0, p_key)  # a float sum may fall short of Z
    return _from_order_key(jnp.maximum(k_key, p_key))


def _order_key(x):
    # Flip negative floats' bits, set positives' sign bit: unsigned order = float order.
    b = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x8000_0000))


def _from_order_key(k):
    return lax.bitcast_convert_type(jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFF_FFFF), ~k),
                                    jnp.float32)


def _bisect(keys, pred, unroll: bool = False):
    """Per row, the largest key t with pred(t) true, given pred(row min) true and pred monotone
    (true below a threshold). 32 halvings of the u32 range land exactly on an element's key.
    unroll (the GPU step): XLA:GPU launches a loop's body from the host at every trip, while
    straight-line kernels go into one CUDA graph."""
    lo = jnp.min(keys, axis=-1, keepdims=True)  # [S, 1]
    hi = jnp.max(keys, axis=-1, keepdims=True) + 1  # pred(max + 1) is false for these filters

    def step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = pred(mid) & (hi - lo > 1)
        return jnp.where(ok, mid, lo), jnp.where(ok | (hi - lo <= 1), hi, mid)

    return lax.fori_loop(0, 32, step, (lo, hi), unroll=32 if unroll else 1)[0]


def _inverse_cdf(scaled, cutoff, u):
    """Token whose slot in the cumulative distribution of exp(scaled) (0 below cutoff) holds
    the fraction u [S] of the total. Two levels (blocks of _BLOCK, then inside the chosen block)
    instead of an [S, V] cumsum: ~15x faster on CPU."""
    s, v = scaled.shape
    b = min(_BLOCK, v)
    nb = -(-v // b)
    top = jnp.max(scaled, axis=-1, keepdims=True)  # always kept: cutoff <= row max
    w = jnp.where(scaled >= cutoff[:, None], jnp.exp(scaled - top), 0.0)  # [S, V]
    w = jnp.pad(w, ((0, 0), (0, nb * b - v))).reshape(s, nb, b)  # [S, NB, B]
    mass = jnp.sum(w, axis=-1)  # [S, NB]
    blk, rest = _locate(mass, u)
    within = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [S, B]
    idx, _ = _locate(within, rest)
    return jnp.minimum(blk * b + idx, v - 1)


def _locate(w, u):
    """First index i [S] with cumsum(w)[i] > u * sum(w) among w > 0 (so a zero-weight entry is
    never chosen), and how far into entry i that point lies, as a fraction of w[i]."""
    n = w.shape[-1]
    cdf = jnp.where(w > 0, jnp.cumsum(w, axis=-1), 0.0)  # [S, N]
    total = jnp.max(cdf, axis=-1)
    target = jnp.clip(u * total, 0.0, jnp.nextafter(total, 0.0))[:, None]
    i = jnp.minimum(jnp.min(jnp.where(cdf > target, jnp.arange(n), n), axis=-1), n - 1)
    wi = jnp.take_along_axis(w, i[:, None], axis=-1)
    rest = target - (jnp.take_along_axis(cdf, i[:, None], axis=-1) - wi)
    return i.astype(jnp.int32), jnp.clip(rest / wi, 0.0, 1.0)[:, 0]


def _argmax(x):
    """First index of the row max [S]. XLA:CPU's variadic-reduce argmax is ~7x slower; the
    barrier stops XLA:CPU fusing max and compare into one slow materialising fusion."""
    v = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)  # [S, 1]
    x, m = lax.optimization_barrier((x, m))
    hit = jnp.where(x == m, jnp.arange(v, dtype=jnp.int32), v)  # [S, V]
    return jnp.minimum(jnp.min(hit, axis=-1), v - 1)


def _top_logprobs(logits, lse, k):
    if k == 0:
        return _no_logprobs(logits.shape[0], 0)
    vals, ids = lax.top_k(logits, k)  # [S, K]
    return ids.astype(jnp.int32), vals - lse[:, None]


def _no_logprobs(s, k):
    return jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32)
