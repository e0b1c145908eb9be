"""Ragged paged-attention kernel (Pallas, Triton GPU backend) and its jax.numpy reference.

One call serves a whole engine step: a flat token axis holding rows of any number of queries
(decode rows of 1, speculative-decoding rows of 2..k, prefill chunks of many), each row attending
causally over its own pages of the engine's KV cache `[L, NB, BS, K, Dh]` (all layers;
block-major; block 0 is the null block). The cache layout and Triton conventions are those of
`paged_attention.py` (the decode-only kernel): whole-array refs with in-kernel indices, so no
per-layer slice of the cache is ever materialised.

Grid (tile, kv_head, split). A tile is Bq consecutive queries of one row times the G query heads
sharing one KV head, padded to Gp = next power of 2: M = Bq * Gp rows (>= 16, Triton's dot).
Packing heads into the rows lets a decode row fill a tile with its G heads as the decode kernel
does. Tiles are numbered as vLLM's unified attention numbers them: row r's tiles start at
`query_start[r] // Bq + r`, so `T // Bq + R` tiles always suffice and each program finds its row
by a binary search over `query_start`; tiles past their row's queries run no page loop. A
program visits only the pages its last query can see (causal bound), several pages per loop
step (one softmax update per step), optionally split: the S programs of a tile share the pages
it really sees, counted at run time, and a jnp combine merges their partial (out, max, sum), so
a few long rows still fill the GPU (docs/perf_kernels.md).

Nothing around the call depends on the layer: q is read and the output written by row, in
place, from and to the model's flat `[T, H, Dh]` layout (queries may sit in a wider packed
`[T, Hq, Dh]` array), so no padded or transposed copy, no token->row search and no select run
per layer; the tokens of no row are zeroed by the tile of their own number. A step that is
mostly prefill (the tall 64-row tile) runs its short rows, decodes, in a first call on the
16-row tile, one tile per row, and the others in a second call writing the same output.

`ragged_paged_attention_write` also writes the step's keys and values (float caches): programs
run in no order, so each reads from the cache only the positions before its row's first query
and the step's own keys from the packed array, and writes its tile's tokens' keys and values
into the caches aliased to its outputs (docs/perf_kernels.md).

GPU (Triton) support: head_dim 64 or 128 (powers of 2), bf16 and f32 (f32 dots at IEEE
precision, not TF32), block sizes 8..128 (powers of 2) and 256 in bf16: at 256 slots the f32
pages overflow an H200's 227 KiB of shared memory (seen in deviceless sm_90a compiles, as is
that the default tiles of every other combination fit).

int8 cache (k_scale/v_scale given, jaxserve/runtime/kv_quant.py): codes `[L, NB, BS, K, Dh]`
int8 and float32 scales `[L, NB, BS, K]` per (token, KV head). Codes convert exactly to q's
dtype (|code| <= 127) for the dots; a page's key scales multiply its logits and its value
scales the probabilities of the PV dot, in float32, so no dequantized page is materialised.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import (MIN_DOT_ROWS, NO_WINDOW, default_num_splits,
                                      default_pages_per_step, next_pow2)
from pallas_kernels.merge_splits import merge_splits
from pallas_kernels.ragged_attention_kernel import ragged_kernel
from pallas_kernels.paged_attention import check_scales
# The reference lives in its own module; importable from here as before.
from pallas_kernels.ragged_paged_attention_reference import \
    ragged_paged_attention_reference  # noqa: F401

_PREFILL_DOT_ROWS = 64   # tile rows when the step is mostly prefill: fewer re-reads of the pages
_MAX_PREFILL_TILE_BLOCK = 64  # largest block size that takes the taller prefill tile


def _ragged_call(layer, window, query_start, context_lens, page_table, q, k_cache, v_cache,
                 scales, *, num_tiles: int, block_q: int, gp: int, group: int, q_heads: int,
                 num_splits: int, pages_per_step: int, sm_scale: float, softcap: float | None,
                 num_warps: int, num_stages: int, interpret, short_rows: int | None = None,
                 prev: tuple = (), slots=None):
    """q `[T * Hq, Dh]`. One split: the output `[T * H, Dh]` in q's dtype. Several: partial
    out `[S * T * H, Dh]`, max and sum `[S * T * H]`, f32. scales: an int8 cache's (k_scale,
    v_scale), or () for a float cache. short_rows: which rows (see ragged_kernel); prev: an
    earlier call's outputs, which this call's outputs alias (it writes the other rows).
    slots `[T]`: write the step's keys and values (in q) to the caches, which come back
    after the outputs (aliased: in place). Returns (out, max, sum, caches)."""
    head_dim = q.shape[1]
    num_kv_heads = k_cache.shape[3]
    rows = q.shape[0] // q_heads * num_kv_heads * group  # T * H
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, head_dim), q.dtype)]
    else:  # the combine needs each split's max and sum
        out_shape = [jax.ShapeDtypeStruct((num_splits * rows, head_dim), jnp.float32),
                     *[jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32)] * 2]
    kernel = functools.partial(ragged_kernel, block_q=block_q, gp=gp, group=group,
                               q_heads=q_heads, num_splits=num_splits,
                               pages_per_step=pages_per_step, sm_scale=sm_scale,
                               softcap=softcap, quantized=bool(scales), short_rows=short_rows,
                               num_outputs=len(out_shape), write_kv=slots is not None)

    # Whole arrays: on Triton a ref is a pointer into global memory, nothing is copied; the
    # kernel computes its own indices (see paged_attention.py).
    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))

    write = () if slots is None else (slots,)
    args = (layer, window, query_start, context_lens, page_table, q, k_cache, v_cache,
            *scales, *write, *prev)
    aliases = {len(args) - len(prev) + i: i for i in range(len(prev))}
    if write:  # the caches (inputs 6, 7) come back after the attention outputs
        aliases.update({6: len(out_shape), 7: len(out_shape) + 1})
        out_shape = out_shape + [jax.ShapeDtypeStruct(c.shape, c.dtype)
                                 for c in (k_cache, v_cache)]
    outs = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=[whole(x) for x in args],
        out_specs=[whole(x) for x in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        # Interpreters ignore Triton params, and the strict (TPU) interpreter rejects them.
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                                    num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*args)
    outs, caches = outs[:len(outs) - 2 * len(write)], tuple(outs[len(outs) - 2 * len(write):])
    return (*(outs if num_splits > 1 else (outs[0], None, None)), caches)


def _default_queries_per_tile(num_tokens: int, num_rows: int, gp: int,
                              block_size: int) -> int:
    # Decode-shaped steps (about one token per row) take the smallest tile; steps with more
    # tokens than that are mostly prefill, where a taller tile reads each page fewer times.
    # Pages of 128+ slots keep the small tile: a tall one overflows an H200's shared memory
    # in f32.
    prefill = num_tokens > 2 * num_rows and block_size <= _MAX_PREFILL_TILE_BLOCK
    return max(1, (_PREFILL_DOT_ROWS if prefill else MIN_DOT_ROWS) // gp)


def _schedule(num_tiles: int, num_kv_heads: int, num_pages: int, block_size: int, dtype,
              rows: int, pages_per_step, num_splits, num_warps) -> tuple[int, int, int]:
    """(pages per step, splits, warps): the given values, else the defaults."""
    step = pages_per_step or default_pages_per_step(block_size, dtype, num_pages)
    if step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")
    splits = num_splits or default_num_splits(num_tiles * num_kv_heads, num_pages)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # 8 warps only for the tall prefill tile: the 16-row tile spills with 8 (sm_90a ptxas).
    tall = rows >= _PREFILL_DOT_ROWS
    return step, splits, num_warps or (8 if tall and step * block_size >= 128 else 4)


_STATIC = ("num_heads", "queries_per_tile", "short_queries_per_tile", "num_splits",
           "pages_per_step", "sm_scale", "softcap", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_write(qkv, k_cache, v_cache, layer, slots, page_table, query_start,
                                 context_lens, *, num_heads: int, **kw):
    """Writes the step's keys and values into the float caches and attends, in one launch
    (two in a step with short rows). qkv `[T, H + 2K, Dh]`: each token's H = num_heads
    queries, then its K keys, then its K values, in the caches' dtype; slots `[T]` int32: each
    token's flat slot (block * BS + offset) in the layer; tokens of no row are not written.
    context_lens count the step's keys. Other arguments as ragged_paged_attention. Returns
    (`[T, H, Dh]`, k_cache, v_cache), the caches updated in place when donated (the step
    donates them)."""
    num_kv_heads = k_cache.shape[3]
    if k_cache.dtype == jnp.int8 or qkv.shape[1] != num_heads + 2 * num_kv_heads or \
            slots.shape != qkv.shape[:1]:
        raise ValueError(f"qkv {qkv.shape} and slots {slots.shape} must hold {num_heads} "
                         f"queries and {num_kv_heads} keys and values per token, for a "
                         f"float cache (got {k_cache.dtype})")
    out, (k_cache, v_cache) = _attend(qkv, k_cache, v_cache, layer, page_table, query_start,
                                      context_lens, num_heads=num_heads, slots=slots, **kw)
    return out, k_cache, v_cache


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention(q, k_cache, v_cache, layer, page_table, query_start, context_lens,
                           **kw) -> jax.Array:
    """Causal attention of ragged rows of queries over their pages of the KV cache.

    Args:
      q: `[T, Hq, Dh]` in the cache's dtype (bf16 or f32; int8 cache: bf16 or f32), a flat
        token axis whose first H = K * G heads are the queries (`num_heads`); the others are
        not read (the step's keys and values packed beside them, so that one fusion makes
        all three).
      k_cache, v_cache: `[L, NB, BS, K, Dh]` the caches of all layers (block 0 = null block).
      k_scale, v_scale: int8 caches only: `[L, NB, BS, K]` float32, each (token, KV head)'s
        scale (the cache's values are codes * scale); None for float caches.
      layer: int32 scalar, may be traced (e.g. inside `lax.scan` over layers).
      page_table: `[R, P]` int32 block ids; position i of row r is at
        `(page_table[r, i // BS], i % BS)`. Entries past the context may hold anything.
      query_start: `[R + 1]` int32, non-decreasing: row r's queries are the flat tokens
        `[query_start[r], query_start[r + 1])`. Rows with no query are padding.
      context_lens: `[R]` int32: row r's keys are positions `[0, context_lens[r])`; its i-th
        query sits at position `context_lens[r] - q_len_r + i` and sees keys at positions up to
        its own.
      window: int32 scalar or None, may be traced (the layer's sliding window): a query at
        position p sees keys at positions (p - window, p]; None: no window.
      softcap: static float or None: logits become `softcap * tanh(logits / softcap)` before
        the mask (Gemma 2's attention-logit soft-capping).
      num_heads: H, static; None: all of q's heads.
      queries_per_tile: Bq, a power of 2 with Bq * Gp >= 16 on GPU (any in interpret mode);
        None picks 16 / Gp tile rows for decode-shaped steps (T <= 2R) and 64 / Gp otherwise
        (16 / Gp for block sizes over 64).
      short_queries_per_tile: Bs < Bq, a power of 2, or 0: rows of at most Bs queries (the
        decodes of a mixed step) run on tiles of Bs queries, one per row, in a call of their
        own before the other rows' (two launches). None: 16 / Gp when the tall prefill tile
        was picked by default, else 0 (one call, one tile size).
      num_splits: S, programs sharing each tile's pages (static); each takes an equal share
        of the pages the tile really sees, counted at run time. None: 1 when the tiles alone
        give an H200 132 programs, else enough for about 264, at most 16 and the table's width.
      pages_per_step: pages loaded per loop step (one softmax update for all of them); None
        picks 128 keys per step in bf16 (at most the table's width), one page in f32.
      sm_scale: logit scale, default `1 / sqrt(Dh)`.
      num_warps, num_stages: Triton launch parameters; num_warps None picks 8 for 64-row
        tiles whose steps hold 128 keys or more, else 4.
      interpret: False on GPU; True (or an interpreter's params object) to run on CPU.
    Returns:
      `[T, H, Dh]` in q.dtype; tokens that belong to no row are zeros.
    """
    if "slots" in kw:
        raise TypeError("ragged_paged_attention does not write the cache: call "
                        "ragged_paged_attention_write for the fused KV write")
    return _attend(q, k_cache, v_cache, layer, page_table, query_start, context_lens, **kw)[0]


def _attend(q, k_cache, v_cache, layer, page_table, query_start, context_lens, *,
            k_scale=None, v_scale=None, slots=None,
            window=None, softcap: float | None = None,
            num_heads: int | None = None,
            queries_per_tile: int | None = None,
            short_queries_per_tile: int | None = None,
            num_splits: int | None = None,
            pages_per_step: int | None = None, sm_scale: float | None = None,
            num_warps: int | None = None, num_stages: int = 2,
            interpret=False):
    """ragged_paged_attention (its arguments), and with slots the fused KV write: returns
    (`[T, H, Dh]`, (k_cache, v_cache)), the caches as written (as given without slots)."""
    num_tokens, q_heads, head_dim = q.shape
    num_heads = num_heads or q_heads
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, num_pages = page_table.shape
    scales = check_scales(q, k_cache, v_cache, k_scale, v_scale)
    if num_heads % num_kv_heads or num_heads > q_heads or k_cache.shape != v_cache.shape or \
            k_cache.shape[-1] != head_dim or query_start.shape != (num_rows + 1,) or \
            context_lens.shape != (num_rows,):
        raise ValueError(f"incompatible shapes q {q.shape}, k {k_cache.shape}, "
                         f"v {v_cache.shape}, page_table {page_table.shape}, "
                         f"query_start {query_start.shape}, context_lens {context_lens.shape}")
    group = num_heads // num_kv_heads
    gp = next_pow2(group)
    bq = queries_per_tile or _default_queries_per_tile(num_tokens, num_rows, gp, block_size)
    if bq & (bq - 1):
        raise ValueError(f"queries_per_tile must be a power of 2, got {queries_per_tile}")
    if not interpret and bq * gp < MIN_DOT_ROWS:
        raise ValueError(f"queries_per_tile {bq} x {gp} padded heads is under the "
                         f"{MIN_DOT_ROWS} rows Triton's dot needs: use at least "
                         f"{MIN_DOT_ROWS // gp}")
    short_q = short_queries_per_tile
    if short_q is None:
        short_q = max(1, MIN_DOT_ROWS // gp) if queries_per_tile is None else 0
        short_q = short_q if short_q < bq else 0
    if short_q and (short_q & (short_q - 1) or short_q >= bq):
        raise ValueError(f"short_queries_per_tile must be a power of 2 under {bq}, got "
                         f"{short_queries_per_tile}")
    # Row r's tiles start at query_start[r] // Bq + r; tiles 0 .. ceil(T / Bq) - 1 also zero
    # the tokens of no row, and T // Bq + R >= ceil(T / Bq) as R >= 1.
    num_tiles = num_tokens // bq + num_rows
    step, splits, warps = _schedule(num_tiles + (num_rows if short_q else 0), num_kv_heads,
                                    num_pages, block_size, q.dtype, bq * gp, pages_per_step,
                                    num_splits, num_warps)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(1)
    rows = num_tokens * num_heads
    args = (jnp.asarray(layer, jnp.int32).reshape(1), window, query_start.astype(jnp.int32),
            context_lens.astype(jnp.int32), page_table.astype(jnp.int32),
            q.reshape(num_tokens * q_heads, head_dim))
    call = functools.partial(
        _ragged_call, scales=scales, gp=gp, group=group, q_heads=q_heads, num_splits=splits,
        pages_per_step=step, sm_scale=scale, softcap=softcap, num_stages=num_stages,
        interpret=interpret, slots=None if slots is None else slots.astype(jnp.int32))
    prev, caches = (), (k_cache, v_cache)
    if short_q:  # the short rows first, on their own tile; 4 warps (8 spill at 16 rows)
        *outs, written = call(*args, *caches, num_tiles=num_rows, block_q=short_q,
                              num_warps=num_warps or 4, short_rows=short_q)
        prev, caches = tuple(x for x in outs if x is not None), written or caches
    o, m, l, written = call(*args, *caches, num_tiles=num_tiles, block_q=bq, num_warps=warps,
                            short_rows=-short_q if short_q else None, prev=prev)
    if m is not None:  # one kernel for the combine and the cast (merge_splits.py)
        o = merge_splits(o.reshape(splits, rows, head_dim), m.reshape(splits, rows),
                         l.reshape(splits, rows), out_dtype=q.dtype, interpret=interpret)
    return o.reshape(num_tokens, num_heads, head_dim).astype(q.dtype), written or caches
