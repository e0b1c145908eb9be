"""Ragged paged attention for Hopper on Mosaic GPU (`plgpu.kernel`): TMA, mbarriers, wgmma.

Same contract and reference as the Triton kernel (ragged_paged_attention.py,
ragged_paged_attention_reference.py): one call serves a whole step's ragged rows (decodes,
speculative rows, prefill chunks) on the flat token axis, causally over each row's pages of
the all-layer cache `[L, NB, BS, K, Dh]` (block 0 the null block). It only reads the cache.

Grid (tile, kv_head). A tile is 64 consecutive queries of one row (wgmma's M: 64 rows per
warpgroup), numbered as the Triton kernel numbers them: row r's tiles start at
`query_start[r] // 64 + r`, so `T // 64 + R` tiles always suffice and a program finds its row
by a binary search over query_start (scalars read from SMEM). A program runs G + 1
warpgroups: G compute warpgroups, one per query head sharing the KV head (GQA: each page is
loaded once for all G heads), and a producer that TMAs the row's pages through a ring of
`SLOTS` buffers of `S = max(64, BS)` keys (64 // BS pages per step), only the pages the
tile's last query sees (causal) and none wholly before the window.

q is read by TMA as a box of 64 tokens of one head from `[T, Hq, Dh]` starting at a multiple
of 8 tokens (TMA into an SMEM tile of 8 rows needs the start provably aligned): a row's tiles
cover `[floor8(first query) + 64 j, + 64)`, rows of other rows' tokens are masked, and a box
running past T is zero-filled by TMA (by the interpreter too). The output is written token by
token (one TMA of `[Dh]` per real query and head): two programs never write the same (token,
head), so tiles need no ordering; the tokens of no row are zeroed by the tile of their own
number (tiles `0 .. ceil(T / 64) - 1`), as the Triton kernel does.

Masked keys: q.k of a garbage (NaN) slot is replaced by -inf, but p = 0 times a NaN value
is NaN inside wgmma, so the producer zeroes, in SMEM, the value rows at or past the tile's
causal bound in its last step before handing the slot over (the only rows that can hold
slots past a context or pages past the table's live entries).

Decode rows waste 63 of the tile's 64 rows (a tile per token and head): decode is bound by
the page reads, which are shared by the G heads, so the wasted wgmma rows cost compute that
is idle anyway; packing a decode token's G heads into one tile would need a 3-D q box and a
reshaped swizzled SMEM tile (not done). No split of long contexts over programs
(flash-decoding): a batch-1 decode runs K programs (see `cost`).

Supported: bf16 q, bf16 or int8 caches, head_dim 64 or 128, block sizes 16, 32, 64, 128
(128 only where SMEM allows: not the 8B model's G = 4, head_dim 128), G <= 4 query heads per
KV head (SMEM holds G query and output tiles; threads (G + 1) * 128). Refused, with the
reason from `unsupported`: f32 (wgmma would run it as TF32, not the reference's precision)
and other cache types.

int8 caches (codes `[L, NB, BS, K, Dh]`, f32 scales `[L, NB, BS, K]`): wgmma takes no int8
operand beside a bf16 one from SMEM, and one KV head's scales of a page are `[BS]` at stride
K, which no TMA box reads. So the producer stages each page's codes (int8, a TMA as for bf16)
and its whole scale slab `[BS, K]` (contiguous; read from the flattened scales, rounded up
to the 128 bytes a copy moves, zeros past the array's end), then writes the codes as bf16
into the slot (exact) and gathers its head's `[keys]` scales by scalar SMEM reads
(ragged_paged_attention_mgpu_int8.py). The compute warpgroups multiply the logits' columns by
the key scales and p's columns by the value scales in f32 before p is rounded to bf16: the
Triton kernel's arithmetic, so its tolerances hold. Garbage slots have finite codes and
possibly NaN scales: the value scales outside the tile's keys are zeroed, the logits there
are masked to -inf as before. Costs beside bf16: half the cache bytes, plus per step the
producer's conversion (registers) and a gather of `keys` scalars per K and V, which on a
GPU may make the single producer warpgroup, not HBM, the bound at batch 1 (only a GPU run
can tell).

Lowered with Lane semantics (Warpgroup semantics' layout inference cannot tile the plain
SMEM the output is stored to and sent row by row), so every TMA moves a multiple of 128
bytes: the metadata and page-table rows are padded to 32 int32. The interpreter runs
wgmma only on SMEM operands and has neither run_state nor accumulator stores, so under
`interpret` p goes through SMEM and the PV product is added from a fresh accumulator: the
same sums; on a GPU p stays in registers and the accumulator is updated in place.

In the GPU interpreter a program of G + 1 >= 4 warpgroups needs XLA:CPU's thread pool to
have as many threads (pallas_kernels/mosaic_interpret.py): on a 2-core machine it hung, e.g.
G = 3 with a padding row between rows, with two warpgroups' barrier waits holding both pool
threads. That was the interpreter's host, not the kernel: with NPROC=8 the same case passes
against the oracle, race detection on.

What only a GPU run can show: speed, the register budget of the G + 1 warpgroups at run
time (deviceless compiles pass), and the real TMA's zero-fill of a q box past T.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import ragged_paged_attention_mgpu_int8 as int8
from pallas_kernels.gpu_tiling import NO_WINDOW
from pallas_kernels.paged_attention import check_scales

TILE = 64          # queries per tile: wgmma's M per warpgroup
SLOTS = 2          # KV ring depth
META_W = 32        # int32 rows of 128 bytes: Lane-semantics TMAs move multiples of 128 bytes
MAX_GROUP = 4
BLOCK_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (64, 128)
SMEM_BYTES = 227 * 1024


def _smem_bytes(group: int, head_dim: int, block_size: int, num_kv_heads: int | None = None,
                stages: int = 0) -> int:
    """Shared memory of a program; num_kv_heads and stages for an int8 cache."""
    keys = max(TILE, block_size)
    size = 2 * (2 * group * TILE * head_dim + 2 * SLOTS * keys * head_dim)
    if num_kv_heads is not None:
        size += int8.smem_bytes(keys, head_dim, block_size, num_kv_heads, stages, SLOTS)
    return size


def _stages(group: int, head_dim: int, block_size: int, num_kv_heads: int) -> int:
    """int8 caches: staging buffers of codes and scales (2 where shared memory allows)."""
    return 2 if _smem_bytes(group, head_dim, block_size, num_kv_heads, 2) <= SMEM_BYTES else 1


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype, kv_dtype=None) -> str | None:
    """Why this kernel cannot serve the shape, or None when it can. dtype: q's; kv_dtype: the
    cache's (None: q's)."""
    dtype = jnp.dtype(dtype)
    kv_dtype = dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    if dtype != jnp.bfloat16:
        return f"q must be bfloat16 (wgmma would run {dtype.name} as TF32), got {dtype.name}"
    if kv_dtype not in (jnp.bfloat16, jnp.int8):
        return f"the cache must be bfloat16 or int8, got {kv_dtype.name}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    if group > MAX_GROUP:
        return f"{group} query heads per KV head: at most {MAX_GROUP} (one warpgroup each)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    if block_size not in BLOCK_SIZES:
        return f"block size {block_size} not in {BLOCK_SIZES}"
    quantized = (num_kv_heads, 1) if kv_dtype == jnp.int8 else ()  # one staging buffer
    need = _smem_bytes(group, head_dim, block_size, *quantized)
    if need > SMEM_BYTES:
        return (f"{need} bytes of shared memory for G={group}, head_dim {head_dim}, block "
                f"size {block_size}{', an int8 cache' if quantized else ''}: over {SMEM_BYTES}")
    return None


def cost(num_tokens: int, num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int,
         block_size: int, context_tokens: int, query_key_pairs: int | None = None,
         int8: bool = False) -> dict:
    """HBM bytes, FLOPs and launches of one call, for the deviceless performance model.

    context_tokens: keys read, summed over the step's 64-query tiles (a row of n queries over
    c keys reads about c keys per tile, ceil(n / 64) tiles; pages are read whole, so round c
    up to block_size); query_key_pairs: (query, key) products summed over queries (default:
    every query of a tile sees all its keys, an upper bound). Each page is read once per
    tile and KV head for all G query heads; wgmma computes whole 64-row tiles, but the model
    counts the useful products. int8: one byte a code, and the pages' f32 scales, whose
    whole slabs every KV head's program reads (HBM once, the others from L2)."""
    if int8:
        kv = 2 * context_tokens * num_kv_heads * (head_dim + 4)  # codes and scales
    else:
        kv = 2 * context_tokens * num_kv_heads * head_dim * 2    # K and V pages, bf16
    qo = 2 * num_tokens * num_heads * head_dim * 2               # q read, output written
    meta = 4 * (2 * num_rows + 3)
    pairs = context_tokens * TILE if query_key_pairs is None else query_key_pairs
    return dict(bytes=kv + qo + meta, flops=4 * pairs * num_heads * head_dim, launches=1)


def ragged_paged_attention_mgpu_kernel(*refs, group: int, num_rows: int, num_tokens: int,
                                       block_size: int, pages_per_step: int, stages: int,
                                       sm_scale: float, softcap: float | None,
                                       quantized: bool, interpreted: bool):
    # Inputs meta, page table, q, k, v[, k_scale, v_scale (int8: [L, NB, BS, K] f32)], the
    # output, then the scratch of plgpu.kernel's scratch_types (the int8 ones None for bf16).
    (meta_ref, pt_ref, q_ref, k_ref, v_ref), refs = refs[:5], refs[5:]
    ks_ref, vs_ref, refs = (*refs[:2], refs[2:]) if quantized else (None, None, refs)
    (o_ref, meta_smem, pt_smem, q_smem, o_smem, zero_smem, k_smem, v_smem, p_smem,
     meta_bar, pt_bar, q_bar, k_bar, v_bar, v_ready, k_free, v_free,
     codes_smem, slab_smem, scale_smem, staged, k_ready) = refs
    tile, kv_head = lax.axis_index("tile"), lax.axis_index("kv")
    wg = lax.axis_index("wg")
    keys = pages_per_step * block_size
    head_dim = q_ref.shape[-1]

    def meta(i):
        return meta_smem[i // META_W, i % META_W]

    @pl.when(wg == group)
    def _():
        plgpu.copy_gmem_to_smem(meta_ref, meta_smem, meta_bar)
    plgpu.barrier_wait(meta_bar)  # every warpgroup needs the row's scalars
    layer, window = meta(0), meta(1)
    qs = lambda r: meta(2 + r)  # noqa: E731
    ctx_len = lambda r: meta(3 + num_rows + r)  # noqa: E731
    first_tile = lambda r: qs(r) // TILE + r  # noqa: E731

    def search(_, lohi):  # largest row whose first tile is <= this tile
        lo, hi = lohi
        mid = (lo + hi) // 2
        ok = first_tile(mid) <= tile
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    row, _ = lax.fori_loop(0, max(1, num_rows.bit_length()), search,
                           (jnp.int32(0), jnp.int32(num_rows)))
    in_row = first_tile(0) <= tile
    q_begin, q_end, ctx = qs(row), qs(row + 1), ctx_len(row)
    # The q box starts at a multiple of 8 tokens (TMA into an SMEM tile of 8 rows needs it):
    # the row's tiles cover [floor8(q_begin) + 64 j, + 64), which can run past T (TMA fills
    # zeros) but never needs more tiles than the numbering gives (q_begin // 64 is unchanged).
    box = pl.multiple_of((q_begin // 8) * 8 + (tile - first_tile(row)) * TILE, 8)
    tok0 = jnp.maximum(box, q_begin)
    tok1 = jnp.where(in_row, jnp.minimum(box + TILE, q_end), tok0)
    has_work = tok1 > tok0
    pos0 = ctx - (q_end - q_begin) - q_begin  # + token = the token's position
    kv_end = pos0 + tok1  # keys [kv_start, kv_end) can be seen by the tile
    kv_start = jnp.maximum(0, pos0 + tok0 - window + 1)
    first_page = kv_start // block_size
    num_pages = jnp.where(has_work, (kv_end + block_size - 1) // block_size - first_page, 0)
    steps = (num_pages + pages_per_step - 1) // pages_per_step
    step_key0 = lambda s: (first_page + s * pages_per_step) * block_size  # noqa: E731

    def _producer():
        plgpu.copy_gmem_to_smem(pt_ref.at[jnp.where(in_row, row, 0)], pt_smem, pt_bar)
        plgpu.barrier_wait(pt_bar)
        last_page = first_page + num_pages - 1

        def issue(step, slot):
            for j in range(pages_per_step):
                # Pages past the tile's bound repeat its last page: their rows are masked
                # (values zeroed below), and the table past a context may hold anything.
                p = jnp.minimum(first_page + step * pages_per_step + j, last_page)
                block = pt_smem[p // META_W, p % META_W]
                dst = pl.ds(j * block_size, block_size)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, block, :, kv_head],
                                        k_smem.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, block, :, kv_head],
                                        v_smem.at[slot, dst], v_bar.at[slot])

        for i in range(SLOTS):
            pl.when(i < steps)(functools.partial(issue, i, i))

        @pl.loop(0, steps)
        def _(step):
            slot = lax.rem(step, SLOTS)
            plgpu.barrier_wait(v_bar.at[slot])

            @pl.when(step == steps - 1)
            def _():  # zero the rows past the bound: p = 0 there, but 0 * NaN is NaN
                v = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
                rows = plgpu.broadcasted_iota(jnp.int32, (keys, head_dim), 0,
                                              layout=plgpu.Layout.WGMMA)
                v_smem.at[slot][...] = jnp.where(rows + step_key0(step) < kv_end, v,
                                                 jnp.zeros_like(v))
                plgpu.commit_smem()
            plgpu.barrier_arrive(v_ready.at[slot])

            @pl.when(step + SLOTS < steps)
            def _():
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                issue(step + SLOTS, slot)

    if not quantized:
        pl.when(wg == group)(_producer)
    else:
        pl.when(wg == group)(functools.partial(
            int8.producer, pt_ref, k_ref, v_ref, ks_ref, vs_ref, pt_smem, pt_bar, k_smem,
            v_smem, k_free, v_free, k_ready, v_ready, codes_smem, slab_smem, scale_smem,
            staged, kv_head=kv_head, layer=layer, row=jnp.where(in_row, row, 0),
            first_page=first_page, num_pages=num_pages, steps=steps, step_key0=step_key0,
            kv_start=kv_start, kv_end=kv_end, block_size=block_size,
            pages_per_step=pages_per_step, stages=stages))

    # One static branch per compute warpgroup: SMEM views at a traced warpgroup index fail
    # Mosaic GPU's layout inference (it cannot prove the view's offset tile-aligned).
    for w in range(group):
        pl.when(wg == w)(functools.partial(
            _compute, w, o_ref, q_ref, q_smem, o_smem, zero_smem, k_smem, v_smem, p_smem,
            q_bar, k_ready if quantized else k_bar, v_ready, k_free, v_free,
            scale_smem if quantized else None, kv_head=kv_head, group=group, tile=tile,
            qs=qs, num_rows=num_rows, num_tokens=num_tokens, has_work=has_work, box=box,
            tok0=tok0, tok1=tok1, pos0=pos0, window=window, keys=keys, steps=steps,
            step_key0=step_key0, sm_scale=sm_scale, softcap=softcap,
            interpreted=interpreted))


def _compute(wg, o_ref, q_ref, q_smem, o_smem, zero_smem, k_smem, v_smem, p_smem, q_bar,
             k_bar, v_ready, k_free, v_free, scale_smem, *, kv_head, group, tile, qs, num_rows,
             num_tokens, has_work, box, tok0, tok1, pos0, window, keys, steps, step_key0,
             sm_scale, softcap, interpreted):
        """Compute warpgroup `wg` (static): query head kv_head * G + wg of the tile. k_bar:
        the slot's keys are in (an int8 cache: in as bf16 codes, with the `[2, keys]` scales
        in scale_smem)."""
        head_dim = q_ref.shape[-1]
        head = kv_head * group + wg
        zero_smem.at[wg][...] = jnp.zeros((2, head_dim), o_ref.dtype)  # >= 128 elements
        plgpu.commit_smem()
        # The tokens of no row, among this tile number's 64: zeros (no other tile owns them).
        lo = tile * TILE
        hi = jnp.minimum(lo + TILE, num_tokens)

        for a, b in ((lo, jnp.minimum(hi, qs(0))), (jnp.maximum(lo, qs(num_rows)), hi)):
            @pl.loop(a, jnp.maximum(a, b))
            def _(t):
                plgpu.copy_smem_to_gmem(zero_smem.at[wg, 0], o_ref.at[t, head])

        @pl.when(has_work)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(box, TILE), head], q_smem.at[wg],
                                    q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
        row_tok = box + plgpu.broadcasted_iota(jnp.int32, (TILE, keys), 0,
                                               layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (TILE, keys), 1, layout=plgpu.Layout.WGMMA)
        q_pos = pos0 + row_tok
        real = (row_tok >= tok0) & (row_tok < tok1)

        def step_fn(step, carry):
            acc, m, l = carry
            slot = lax.rem(step, SLOTS)
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].T)
                plgpu.wgmma_wait(0)
                return acc_ref[...]
            if scale_smem is not None:  # [keys] along the columns, read before the release
                columns = plgpu.Layout.WGMMA.reduce(0)
                k_scale = plgpu.load(scale_smem.at[slot, 0], layout=columns)
                v_scale = plgpu.load(scale_smem.at[slot, 1], layout=columns)
            s = pl.run_scoped(qk, plgpu.ACC((TILE, keys), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * sm_scale
            if scale_smem is not None:
                s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            k_pos = step_key0(step) + col
            seen = real & (k_pos <= q_pos) & (k_pos > q_pos - window)
            s = jnp.where(seen, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_ready.at[slot])

            if scale_smem is not None:  # l sums p: the value scales weigh the values
                p = p * lax.broadcast_in_dim(v_scale, p.shape, [1])
            p16 = p.astype(v_smem.dtype)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem.at[wg] if interpreted else p16, v_smem.at[slot])
                plgpu.wgmma_wait(0)
                return acc_ref[...] if interpreted else None
            if interpreted:
                # The interpreter takes wgmma operands from SMEM only and runs neither
                # run_state nor accumulator stores: p goes through SMEM, and a fresh
                # accumulator is added (the same sums).
                p_smem.at[wg][...] = p16
                plgpu.commit_smem()
                acc = acc + pl.run_scoped(pv, plgpu.ACC((TILE, head_dim), jnp.float32))
            else:  # accumulate in place: no second [64, Dh] f32 accumulator in registers
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        acc = plgpu.layout_cast(jnp.zeros((TILE, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, l = lax.fori_loop(0, steps, step_fn, (acc, m, l))

        @pl.when(has_work)
        def _():
            inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
            o_smem.at[wg][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(
                o_smem.dtype)
            plgpu.commit_smem()

            @pl.loop(tok0, tok1)
            def _(t):
                plgpu.copy_smem_to_gmem(o_smem.at[wg, t - box], o_ref.at[t, head])
        plgpu.wait_smem_to_gmem(0)


def _meta(layer, window, query_start, context_lens):
    """`[M, 32]` int32: layer, window, query_start `[R + 1]`, context_lens `[R]`, zero-padded."""
    flat = jnp.concatenate([jnp.stack([layer, window]), query_start, context_lens])
    pad = -flat.shape[0] % META_W
    return jnp.pad(flat, (0, pad)).reshape(-1, META_W)


_STATIC = ("num_heads", "sm_scale", "softcap", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_mgpu(q, k_cache, v_cache, layer, page_table, query_start,
                                context_lens, *, k_scale=None, v_scale=None, window=None,
                                softcap: float | None = None, num_heads: int | None = None,
                                sm_scale: float | None = None, interpret=False) -> jax.Array:
    """Causal attention of ragged rows of queries over their pages of the KV cache.

    Arguments and result as `ragged_paged_attention` (q `[T, Hq, Dh]` bf16 whose first H =
    num_heads heads are the queries; caches `[L, NB, BS, K, Dh]` bf16; layer and window int32
    scalars, may be traced; page_table `[R, P]`; query_start `[R + 1]`; context_lens `[R]`;
    softcap static). Returns `[T, H, Dh]` bf16, zeros at tokens of no row. interpret: False
    on a Hopper GPU, or `plgpu.InterpretGPUParams(...)` to run on CPU. Raises ValueError for
    what `unsupported` refuses (f32, G > 4, other head dims and block sizes). An int8 cache
    comes with k_scale and v_scale `[L, NB, BS, K]` f32 (bf16 q).
    """
    num_tokens, q_heads, head_dim = q.shape
    num_heads = num_heads or q_heads
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, num_pages = page_table.shape
    quantized = bool(check_scales(q, k_cache, v_cache, k_scale, v_scale))
    if quantized:
        k_scale, v_scale = (int8.flat_scales(x) for x in (k_scale, v_scale))
    if num_heads > q_heads or k_cache.shape != v_cache.shape or \
            k_cache.shape[-1] != head_dim or query_start.shape != (num_rows + 1,) or \
            context_lens.shape != (num_rows,) or num_rows < 1:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k_cache.shape}, "
                         f"v {v_cache.shape}, page_table {page_table.shape}, "
                         f"query_start {query_start.shape}, context_lens {context_lens.shape}")
    why = unsupported(num_heads, num_kv_heads, head_dim, block_size, q.dtype, k_cache.dtype)
    if why:
        raise ValueError(why)
    group = num_heads // num_kv_heads
    page_table = page_table.astype(jnp.int32)
    if num_pages % META_W:
        page_table = jnp.pad(page_table, ((0, 0), (0, -num_pages % META_W)))
    page_table = page_table.reshape(num_rows, -1, META_W)  # [R, P / 32, 32]
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)
    meta = _meta(jnp.asarray(layer, jnp.int32), window, query_start.astype(jnp.int32),
                 context_lens.astype(jnp.int32))
    pages_per_step = max(1, TILE // block_size)
    keys = pages_per_step * block_size
    num_tiles = num_tokens // TILE + num_rows
    stages = _stages(group, head_dim, block_size, num_kv_heads) if quantized else 0
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(
        ragged_paged_attention_mgpu_kernel, group=group, num_rows=num_rows,
        num_tokens=num_tokens, block_size=block_size, pages_per_step=pages_per_step,
        stages=stages, sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale,
        softcap=softcap, quantized=quantized, interpreted=bool(interpret))
    # The compiled program names the custom call by its body (a partial is 'anonymous').
    kernel.__name__ = kernel.func.__name__
    bf16 = jnp.bfloat16
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), bf16),
        grid=(num_tiles, num_kv_heads), grid_names=("tile", "kv"),
        num_threads=group + 1, thread_name="wg",
        scratch_types=[
            plgpu.SMEM(meta.shape, jnp.int32), plgpu.SMEM(page_table.shape[1:], jnp.int32),
            plgpu.SMEM((group, TILE, head_dim), bf16, transforms=tr),
            plgpu.SMEM((group, TILE, head_dim), bf16),
            plgpu.SMEM((group, 2, head_dim), bf16),
            plgpu.SMEM((SLOTS, keys, head_dim), bf16, transforms=tr),
            plgpu.SMEM((SLOTS, keys, head_dim), bf16, transforms=tr),
            # p for the interpreter's wgmma (see the kernel); none on a GPU.
            plgpu.SMEM((group, TILE, keys), bf16, transforms=tr) if interpret else None,
            plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(num_barriers=group),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=SLOTS),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=SLOTS),
            plgpu.Barrier(num_barriers=SLOTS),
            plgpu.Barrier(num_arrivals=group, num_barriers=SLOTS),
            plgpu.Barrier(num_arrivals=group, num_barriers=SLOTS),
            # int8: staged codes and scale slabs, the slots' scale vectors, their barriers.
            *(int8.scratch(stages, SLOTS, pages_per_step, block_size, num_kv_heads, head_dim)
              if quantized else [None] * 5),
        ],
        # Lane semantics: the output tile is stored to a plain SMEM buffer and sent row by
        # row, which Warpgroup semantics' layout inference cannot tile.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(meta, page_table, q, k_cache, v_cache, *((k_scale, v_scale) if quantized else ()))
    return out
