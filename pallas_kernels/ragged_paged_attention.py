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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import (MASK_VALUE, MIN_DOT_ROWS, NO_WINDOW, default_num_splits,
                                      default_pages_per_step, dot, load_rows, next_pow2,
                                      store_page_rows, store_rows)
from pallas_kernels.paged_attention import check_scales
# The reference lives in its own module; importable from here as before.
from pallas_kernels.ragged_paged_attention_reference import \
    ragged_paged_attention_reference  # noqa: F401

_PREFILL_DOT_ROWS = 64   # tile rows when the step is mostly prefill: fewer re-reads of the pages
_MAX_PREFILL_TILE_BLOCK = 64  # largest block size that takes the taller prefill tile


def _find_row(qs_ref, tile, *, num_rows: int, block_q: int):
    """The last row r with `query_start[r] // Bq + r <= tile` (r = 0 if none), by bisection."""
    lo, hi = jnp.int32(0), jnp.int32(num_rows)
    for _ in range(max(1, num_rows).bit_length()):  # static: ceil(log2(R)) + 1 halvings
        mid = (lo + hi) // 2  # < hi <= R: always a row
        ok = qs_ref[mid] // block_q + mid <= tile
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    return lo


def _load_page(k_ref, v_ref, scale_refs, pt_ref, layer, r, h, page, in_split):
    """Keys and values `[BS, Dh]` of row r's page `page` for KV head h, and (int8 cache,
    scale_refs = (k_scale_ref, v_scale_ref)) their scales `[BS]` f32, else None. A page outside
    the split's visible pages (`in_split` false: the next split's, or past the table) reads the
    null block, in bounds, for the caller to mask; the table itself is read in bounds."""
    block_size, head_dim = k_ref.shape[2], k_ref.shape[4]
    block = jnp.where(in_split, pt_ref[r, jnp.minimum(page, pt_ref.shape[1] - 1)], 0)
    index = (layer, block, pl.ds(0, block_size), h, pl.ds(0, head_dim))
    if not scale_refs:
        return k_ref[index], v_ref[index], None, None
    at = (layer, block, pl.ds(0, block_size), h)
    return k_ref[index], v_ref[index], scale_refs[0][at], scale_refs[1][at]


def split_pages(first, end, s, num_splits: int):
    """(first page, page count) of split s of `num_splits` over pages [first, end): equal
    shares of the pages a tile really sees, counted at run time, so a short context in a wide
    page table still keeps every split busy (the grid, and so the split count, is static)."""
    share = pl.cdiv(end - first, num_splits)
    start = first + s * share
    return start, jnp.clip(end - start, 0, share)


def _head_rows(tokens, h, ok, *, gp: int, group: int, num_heads: int):
    """Rows `[M]` of a flat `[T * num_heads]` head axis for tile rows whose queries are
    `tokens` `[M]` (row i holds head i % Gp of KV head h's group), and `ok` `[M]` narrowed to
    real heads (not the group's padding to Gp)."""
    g = lax.broadcasted_iota(jnp.int32, tokens.shape, 0) % gp
    return tokens * num_heads + h * group + g, ok & (g < group)


NEW_KEYS = 16  # the step's keys per loop step of a fused KV write (Triton's dot: N >= 16)


class _NewKeys:
    """The step's keys and values of one row and KV head h, read by row from the packed
    `[T * Hq, Dh]` array (queries, then K keys, then K values per token)."""

    def __init__(self, q_ref, *, row_start, offset, n, h, q_heads: int, num_heads: int,
                 kv_heads: int, head_dim: int):
        self.q_ref, self.row_start, self.offset, self.n, self.h = q_ref, row_start, offset, n, h
        self.q_heads, self.num_heads, self.kv_heads = q_heads, num_heads, kv_heads
        self.head_dim = head_dim

    def rows(self, tokens, which: int):
        """Rows of tokens' key (which 0) or value (1) of head h."""
        return tokens * self.q_heads + self.num_heads + which * self.kv_heads + self.h

    def chunk(self, c):
        """Keys, values `[NEW_KEYS, Dh]`, positions `[1, NEW_KEYS]` and which are real
        `[1, NEW_KEYS]` of chunk c of the row's first n keys."""
        j = c * NEW_KEYS + lax.broadcasted_iota(jnp.int32, (NEW_KEYS,), 0)
        ok = j < self.n
        tokens = self.row_start + j
        k = load_rows(self.q_ref, self.rows(tokens, 0), ok, self.head_dim)
        v = load_rows(self.q_ref, self.rows(tokens, 1), ok, self.head_dim)
        return k, v, (self.offset + j)[None, :], ok[None, :]

    def write(self, cache_outs, slots_ref, layer, tokens, ok):
        """The keys and values of `tokens` `[M]` where ok, into the caches at their slots."""
        slot = plgpu.load(slots_ref.at[jnp.where(ok, tokens, 0)], mask=ok, other=0)  # [M]
        for which, cache in enumerate(cache_outs):
            value = load_rows(self.q_ref, self.rows(tokens, which), ok, self.head_dim)
            store_page_rows(cache, layer, slot, self.h, ok, value)


def _ragged_kernel(layer_ref, window_ref, qs_ref, lens_ref, pt_ref, q_ref, k_ref, v_ref,
                   *refs,  # [k/v_scale_ref,] [slots_ref,] [earlier outputs,] outputs
                   block_q: int, gp: int, group: int, q_heads: int, num_splits: int,
                   pages_per_step: int, sm_scale: float, softcap: float | None,
                   quantized: bool, short_rows: int | None, num_outputs: int,
                   write_kv: bool):
    # layer_ref [1], window_ref [1], qs_ref [R + 1], lens_ref [R], pt_ref [R, P]: whole arrays.
    # q_ref [T * Hq, Dh] whole: the flat token axis as the model makes it (token-major, heads
    # inner; the first H = K * G of each token's Hq heads are queries), read by row, so no
    # padded copy of q is made.
    # k_ref/v_ref [L, NB, BS, K, Dh] whole caches; int8: k/v_scale_ref [L, NB, BS, K] whole.
    # Outputs, whole: one split: o_ref [T * H, Dh] in q's dtype, the final output. Several:
    # partials o_ref [S * T * H, Dh] f32 and m_ref, l_ref [S * T * H] f32 (split s's rows at
    # s * T * H) for the combine.
    # short_rows: None, every row; > 0: only rows of at most that many queries, one tile each
    # (tile r: row r); < 0: only rows of more than -short_rows queries. A mixed step runs its
    # decode rows on a short tile and its prefill rows on a tall one, two calls writing one
    # output (the second's earlier outputs are aliased inputs, not read).
    # write_kv: the step's keys and values are in q_ref beside the queries (heads H .. H + K
    # and H + K .. H + 2K) and slots_ref [T] holds each token's cache slot; the caches hold
    # only the positions before each row's first query. The kernel reads the step's keys from
    # q_ref, never from the cache, and writes them to the caches (aliased outputs
    # k_out, v_out after the attention outputs): programs run in no order, so no program
    # may read a slot another program of the call writes.
    scale_refs = refs[:2] if quantized else ()
    slots_ref = refs[len(scale_refs)] if write_kv else None
    outs = refs[len(refs) - num_outputs - 2 * write_kv:]
    (o_ref, *ml_refs), cache_outs = outs[:num_outputs], outs[num_outputs:]
    t, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = k_ref.shape[2], k_ref.shape[4]
    num_rows = lens_ref.shape[0]
    num_heads = k_ref.shape[3] * group
    num_tokens = q_ref.shape[0] // q_heads
    rows = block_q * gp
    if short_rows is not None and short_rows > 0:
        r, tile_of_row = t, t
    else:
        r = _find_row(qs_ref, t, num_rows=num_rows, block_q=block_q)
        tile_of_row = qs_ref[r] // block_q + r
    row_start = qs_ref[r]
    q_len = qs_ref[r + 1] - row_start
    first = (t - tile_of_row) * block_q  # this tile's first query within the row
    live = (first >= 0) & (first < q_len)
    if short_rows is not None:
        live = live & ((q_len <= short_rows) if short_rows > 0 else (q_len > -short_rows))
    length = lens_ref[r]
    offset = length - q_len  # position of the row's query 0
    cached = offset if write_kv else length  # the keys read from the cache: [0, cached)
    # The tile's last query sees the most keys; pages past it (or past the table) are not read.
    last_pos = offset + jnp.minimum(first + block_q, q_len) - 1
    n_pages = jnp.minimum(pl.cdiv(jnp.maximum(jnp.minimum(last_pos + 1, cached), 0),
                                  block_size), pt_ref.shape[1])
    n_pages = jnp.where(live, n_pages, 0)
    # Sliding window: keys before the tile's first query's window are seen by no tile row.
    window = window_ref[0]
    lo = jnp.maximum(offset + first - window + 1, 0)  # first key position any row sees
    first_page, n_split = split_pages(jnp.minimum(lo // block_size, n_pages), n_pages, s,
                                      num_splits)

    # Tile row i holds query first + i // Gp, head i % Gp of the group.
    query = first + lax.broadcasted_iota(jnp.int32, (rows,), 0) // gp  # [M]
    flat, mine = _head_rows(row_start + query, h, live & (query < q_len), gp=gp,
                            group=group, num_heads=num_heads)  # [M]: output rows it owns
    q_at, _ = _head_rows(row_start + query, h, mine, gp=gp, group=group, num_heads=q_heads)
    q = load_rows(q_ref, q_at, mine, head_dim)  # [M, Dh]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    q_pos = offset + query[:, None]  # [M, 1]
    slot = lax.broadcasted_iota(jnp.int32, (1, block_size), 1)  # [1, BS]

    def page_logits(i, j):
        """Masked logits `[M, BS]` f32, values `[BS, Dh]` and (int8) value scales `[1, BS]`
        f32 (else None) of step i's page j."""
        local = i * pages_per_step + j  # page within this split
        in_split = local < n_split
        k, v, ks, vs = _load_page(k_ref, v_ref, scale_refs, pt_ref, layer_ref[0], r, h,
                                  first_page + local, in_split)
        key_pos = (first_page + local) * block_size + slot  # [1, BS]
        # Slots past the context hold anything, NaN included: p = 0 alone would not cancel
        # 0 * NaN in p @ v, so zero them.
        # Keys before the window (lo) are zeroed too: a page the window left behind may hold
        # anything once its block is reused.
        valid = (key_pos < cached) & (key_pos >= lo) & in_split  # [1, BS]
        if quantized:  # codes are finite; the scales of such slots are not: zero those
            k, v = k.astype(q.dtype), v.astype(q.dtype)  # exact: |code| <= 127
            vs = jnp.where(valid, vs.reshape(1, block_size), 0.0)
        else:
            v = jnp.where(valid.reshape(block_size, 1), v, jnp.zeros_like(v))
        # Causal within the row; a query's own position is < length, so this also hides the
        # slots past the context (from all but the tile rows past the row's queries, which
        # are not stored).
        visible = (key_pos <= q_pos) & (key_pos > q_pos - window) & in_split  # [M, BS]
        if write_kv:  # the slots from the row's first query on are being written
            visible = visible & (key_pos < cached)
        logits = dot(q, k, 1, precision) * sm_scale  # [M, BS] f32
        if quantized:
            logits = logits * ks.reshape(1, block_size)
        return masked_logits(logits, visible), v, vs

    def masked_logits(logits, visible):
        if softcap is not None:  # before the mask, as transformers' Gemma 2
            logits = softcap * jnp.tanh(logits / softcap)
        return jnp.where(visible, logits, MASK_VALUE)

    def body(i, carry):
        # All of a step's pages are loaded before the softmax update: one max and one
        # correction per step, and several pages' loads in flight.
        return update(carry, [page_logits(i, j) for j in range(pages_per_step)])

    def update(carry, pages):
        acc, m_prev, l_prev = carry  # [M, Dh], [M], [M] float32
        m_next = m_prev
        for logits, _, _ in pages:
            m_next = jnp.maximum(m_next, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        acc, l_next = acc * correction[:, None], l_prev * correction
        for logits, v, vs in pages:
            # A row that sees nothing in a split gets garbage (p = 1) there, but its mass l
            # meets exp(MASK_VALUE - max) = 0 in the combine; every real query sees key 0.
            p = jnp.exp(logits - m_next[:, None])
            l_next = l_next + p.sum(axis=-1)
            pw = p if vs is None else p * vs  # int8: p @ (codes * scales) as (p * scales) @ codes
            acc = acc + dot(pw.astype(v.dtype), v, 0, precision)  # [M, Dh] f32
        return acc, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(0, pl.cdiv(n_split, pages_per_step), body, init)
    if write_kv:
        # The step's keys, NEW_KEYS at a time, from the row's first query to the tile's last
        # (split 0 only); keys before the window start are skipped.
        n_new = jnp.where(live & (s == 0), jnp.minimum(first + block_q, q_len), 0)
        new = _NewKeys(q_ref, row_start=row_start, offset=offset, n=n_new, h=h,
                       q_heads=q_heads, num_heads=num_heads, kv_heads=k_ref.shape[3],
                       head_dim=head_dim)

        def new_body(c, carry):
            k, v, key_pos, ok = new.chunk(c)
            visible = (key_pos <= q_pos) & (key_pos > q_pos - window) & ok & (key_pos >= 0)
            logits = dot(q, k, 1, precision) * sm_scale  # [M, NEW_KEYS] f32
            return update(carry, [(masked_logits(logits, visible), v, None)])

        first_new = jnp.maximum(lo - offset, 0) // NEW_KEYS
        carry = lax.fori_loop(first_new, pl.cdiv(n_new, NEW_KEYS), new_body, carry)
        # Each token's K and V for head h once: by its tile's rows of head 0, in split 0.
        g0 = (lax.broadcasted_iota(jnp.int32, (rows,), 0) % gp == 0) & mine & (s == 0)
        new.write(cache_outs, slots_ref, layer_ref[0], row_start + query, g0)
    acc, m, l = carry
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]

    # Tokens that belong to no row (before query_start[0], from query_start[R] on) get zeros
    # from the tile of the same number: tiles 0 .. T / Bq cover every token, and no live tile
    # writes those tokens, so no two programs write one row.
    # The short-row call has R tiles, maybe fewer than T / Bq: the other call zeroes them.
    zero_spare = short_rows is None or short_rows < 0
    token = t * block_q + lax.broadcasted_iota(jnp.int32, (rows,), 0) // gp  # [M]
    spare = (token < num_tokens) & ((token < qs_ref[0]) | (token >= qs_ref[num_rows]))
    flat0, spare = _head_rows(token, h, spare, gp=gp, group=group, num_heads=num_heads)
    part = s * num_tokens * num_heads  # split s's partials start at row s * T * H
    if not ml_refs:
        store_rows(o_ref, flat, mine, out.astype(o_ref.dtype))
    else:
        store_rows(o_ref, flat + part, mine, out)
        for ref, value in ((ml_refs[0], m), (ml_refs[1], l)):
            store_rows(ref, flat + part, mine, value)
    if zero_spare:
        store_rows(o_ref, flat0 + part, spare, jnp.zeros_like(out, o_ref.dtype))
        # Spare rows: mass 0 and a finite max, so the combine gives them 0.
        for ref, empty in zip(ml_refs, (MASK_VALUE, 0.0)):
            store_rows(ref, flat0 + part, spare, jnp.full_like(m, empty))


def _ragged_call(layer, window, query_start, context_lens, page_table, q, k_cache, v_cache,
                 scales, *, num_tiles: int, block_q: int, gp: int, group: int, q_heads: int,
                 num_splits: int, pages_per_step: int, sm_scale: float, softcap: float | None,
                 num_warps: int, num_stages: int, interpret, short_rows: int | None = None,
                 prev: tuple = (), slots=None):
    """q `[T * Hq, Dh]`. One split: the output `[T * H, Dh]` in q's dtype. Several: partial
    out `[S * T * H, Dh]`, max and sum `[S * T * H]`, f32. scales: an int8 cache's (k_scale,
    v_scale), or () for a float cache. short_rows: which rows (see _ragged_kernel); prev: an
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
    kernel = functools.partial(_ragged_kernel, block_q=block_q, gp=gp, group=group,
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


def _merge_splits(o, m, l):
    """The output `[N, Dh]` f32 from S partial ones `[S, N, Dh]` (max, sum `[S, N]`): each
    split's normalised output weighted by its share of the softmax mass."""
    w = l * jnp.exp(m - m.max(axis=0))  # [S, N]; empty splits have l = 0
    total = w.sum(axis=0)
    return (o * w[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


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
    if m is not None:
        o = _merge_splits(o.reshape(splits, rows, head_dim), m.reshape(splits, rows),
                          l.reshape(splits, rows))
    return o.reshape(num_tokens, num_heads, head_dim).astype(q.dtype), written or caches
