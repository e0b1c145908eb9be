"""What the paged-attention kernels (paged_attention.py, ragged_paged_attention.py) and the KV
write (kv_write.py) share: the H200 figures their default schedules are sized for, the
f32-accumulating dot, the default pages per loop step and splits, and row gathers / scatters."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so a fully masked row never computes inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_DOT_ROWS = 16       # query rows per program: Triton's tensor-core dot wants M >= 16
NUM_SMS = 132           # H200
TARGET_PROGRAMS = 264   # 2 x 132 SMs
MAX_SPLITS = 16         # at most this many programs share one row's pages (as JAX's GPU kernel)
STEP_KEYS = {"bfloat16": 128}  # keys per loop step by default (other dtypes: a page)
NO_WINDOW = 1 << 30     # a sliding window that never cuts (global layers)


def dot(a, b, b_contract: int, precision):
    """a @ b contracting a's axis 1 with b's `b_contract`, accumulated in float32; HIGHEST keeps
    f32 inputs at IEEE precision (DEFAULT is TF32)."""
    return lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def softmax_update(carry, pages, precision):
    """One online-softmax step over a group of pages loaded together: carry (acc [M, Dh],
    running max [M], running sum [M]) float32; pages [(logits [M, BS] f32, values [BS, Dh],
    int8 value scales [BS] or None)]. One rescale per group, not per page."""
    acc, m_prev, l_prev = carry
    m_next = m_prev
    for logits, _, _ in pages:
        m_next = jnp.maximum(m_next, logits.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    acc, l_next = acc * correction[:, None], l_prev * correction
    for logits, v, vs in pages:
        p = jnp.exp(logits - m_next[:, None])
        l_next = l_next + p.sum(axis=-1)
        pw = p if vs is None else p * vs  # int8: p @ (codes * scales) as (p * scales) @ codes
        acc = acc + dot(pw.astype(v.dtype), v, 0, precision)  # [M, Dh] f32
    return acc, m_next, l_next


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_pages_per_step(block_size: int, dtype, num_pages: int) -> int:
    """bf16: enough pages per loop step for 128 keys, but no more than the table holds. f32 (IEEE
    dots, many registers) keeps one page: two already spill in the ragged kernel's tall tile."""
    keys = STEP_KEYS.get(jnp.dtype(dtype).name, block_size)
    return min(max(1, keys // block_size), num_pages)


def default_pages_per_split(programs: int, num_pages: int, pages_per_step: int) -> int:
    """Pages per split for a grid of `programs` (without splits). Enough programs to give every
    SM of an H200 one need no split (and skip the combine of partial results); otherwise about
    two programs per SM, a whole number of steps each, at most MAX_SPLITS splits."""
    if programs >= NUM_SMS:
        return num_pages
    steps = pl.cdiv(num_pages, pages_per_step)
    splits = min(MAX_SPLITS, steps, pl.cdiv(TARGET_PROGRAMS, programs))
    return pl.cdiv(steps, splits) * pages_per_step


def default_num_splits(programs: int, num_pages: int) -> int:
    """Splits for the ragged kernel, whose splits divide each tile's real pages at run time: 1
    when `programs` (without splits) give every SM of an H200 one, else about two programs per
    SM, at most MAX_SPLITS and at most the table's width."""
    if programs >= NUM_SMS:
        return 1
    return max(1, min(MAX_SPLITS, num_pages, pl.cdiv(TARGET_PROGRAMS, programs)))


def load_rows(ref, rows, ok, width: int, col0=0):
    """ref[rows, col0:col0 + width] `[M, width]` for row indices `rows` `[M]` into a 2-D
    whole-array ref; zeros where `ok` `[M]` is false (those lanes read nothing on a GPU)."""
    col = col0 + lax.broadcasted_iota(jnp.int32, (rows.shape[0], width), 1)
    at = jnp.where(ok, rows, 0)[:, None] + 0 * col
    return plgpu.load(ref.at[at, col], mask=ok[:, None] & (col >= 0), other=0)


def store_rows(ref, rows, ok, value, col0=0):
    """ref[rows] = value (`[M]`, or `[M, W]` at columns col0 .. col0 + W) where ok `[M]`: a
    scatter of rows into a whole-array ref. Masked lanes point past the array: the interpreter
    drops such writes, where a negative or clamped index could land on a row another lane
    writes (a GPU never touches them)."""
    rows = jnp.where(ok, rows, ref.shape[0])
    if value.ndim == 1:
        plgpu.store(ref.at[rows], value, mask=ok)
        return
    col = col0 + lax.broadcasted_iota(jnp.int32, value.shape, 1)
    plgpu.store(ref.at[rows[:, None] + 0 * col, col], value, mask=ok[:, None] & (col >= 0))


def store_page_rows(cache_ref, layer, slots, h, ok, value):
    """cache_ref[layer, slot // BS, slot % BS, h] = value `[M, Dh]` for slots `[M]` where ok:
    a scatter of token rows into a whole `[L, NB, BS, K, Dh]` cache. Masked lanes point past
    the blocks (dropped by the interpreter, untouched on a GPU)."""
    block_size = cache_ref.shape[2]
    col = lax.broadcasted_iota(jnp.int32, value.shape, 1)
    block = jnp.where(ok, slots // block_size, cache_ref.shape[1])[:, None] + 0 * col
    offset = (slots % block_size)[:, None] + 0 * col
    plgpu.store(cache_ref.at[layer, block, offset, h, col], value,
                mask=ok[:, None] & (col >= 0))
