"""The ragged paged-attention kernel on refs (Pallas, Triton GPU backend): the program of one
(tile, KV head, split). Its pallas_call wrapper, schedule and public functions are in
ragged_paged_attention.py, whose docstring describes the layout."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import (MASK_VALUE, dot, load_rows, softmax_update, store_page_rows,
                                      store_rows)


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


def ragged_kernel(layer_ref, window_ref, qs_ref, lens_ref, pt_ref, q_ref, k_ref, v_ref,
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
        # A row that sees nothing in a split gets garbage (p = 1) there, but its mass l meets
        # exp(MASK_VALUE - max) = 0 in the combine; every real query sees key 0.
        return softmax_update(carry, pages, precision)

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
