"""Grouped matmul (a mixture-of-experts FFN projection) over rows sorted by group, without dense
all-groups compute: a Pallas (Triton GPU) kernel, the same tiling in plain XLA, and a reference.

    y[r] = x[r] @ w[g(r)],  x [M, K] rows sorted by group, w [E, K, N], group_sizes [E]

where rows `sum(sizes[:g]) .. sum(sizes[:g + 1]) - 1` belong to group g (an expert); rows past
`sum(sizes)` belong to none and give zeros (as `jax.lax.ragged_dot`).

The megablox tiling: the row axis is cut into T = ceil(M / tm) tiles of tm rows; a work item is
one (tile, group) pair whose rows intersect. A group of s > 0 rows meets ceil(s / tm) tiles,
plus one when it starts inside a tile, so `T + E - 1` items always suffice (`num_items`
tightens it when M - T is smaller): a static schedule length, computed on the device from the
group sizes (`schedule`), the unused items marked invalid. Item i multiplies tile `tile[i]`'s
tm rows by group `group[i]`'s whole `[K, N]` weight into its own `[tm, N]` output block; rows
of the tile that belong to other groups are computed and thrown away. Each row r then takes
its output from the one item (its tile, its group) by a gather (`combine`): no accumulation
across items, so a tile shared by two groups merges exactly and deterministically.
Work: `num_items * tm * K * N` multiply-adds at most (valid items only, in the kernel),
against `E * M * K * N` for the dense masked product XLA makes of `ragged_dot` on CPU and GPU
(docs/moe.md).

Weights are float `[E, K, N]`, or int8 codes stored output-major `[E, N, K]` (w8a16's
Int8Weight, models/quantized.py) with per-(group, output channel) scales `[E, N]`: the codes are
converted to the activation dtype inside the product (exact) and the scale applied to the f32
accumulator. Results are float32 `[M, N]`.

GPU (Triton) constraints: K and N multiples of 16 (Triton's dot wants every dimension >= 16,
and blocks are powers of 2); f32 dots at IEEE precision (HIGHEST), not TF32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import next_pow2

_MIN_DOT = 16            # Triton's dot wants every dimension >= 16
_MAX_BLOCK_N = 128
_MAX_BLOCK_K = 64
_PREFILL_ROWS = 256      # above this many rows the kernel takes taller (64-row) tiles


def num_items(m: int, num_groups: int, tm: int) -> int:
    """The schedule's static length, T + min(E - 1, M - T) for T = ceil(M / tm) row tiles.

    Items beyond the T tiles come from groups that start inside a tile (not on a tile's first
    row): at most one per group after the first, and at most one per row that does not start a
    tile (M - T of them; none when tm = 1, where each row is its own tile)."""
    t = -(-m // tm)
    return t + min(num_groups - 1, m - t)


def schedule(group_sizes, m: int, tm: int):
    """Work items of the tiling (module docstring), computed on the device.

    group_sizes `[E]` int; m rows (static); tm rows per tile (static). Returns int32 arrays
    `[I]`, I = num_items(m, E, tm): tile (row tile of the item), group (its group), valid
    (1 for the real items, which come first, ordered by group then tile; 0 for the padding,
    whose tile and group are 0 and E - 1 so that they index in range); and the per-group
    `[E]` (first_tile, first_item) that `combine` needs.
    """
    e = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)  # [E]: rows past m are dropped, never indexed
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [E]
    first_tile = starts // tm  # [E]
    tiles = jnp.where(ends > starts, (ends - 1) // tm - first_tile + 1, 0)  # [E]
    item_end = jnp.cumsum(tiles)  # [E]
    first_item = item_end - tiles  # [E]
    items = jnp.arange(num_items(m, e, tm), dtype=jnp.int32)  # [I]
    # The group of item i: how many groups end at or before it (a compare, no sort).
    group = jnp.sum(items[:, None] >= item_end[None, :], axis=1, dtype=jnp.int32)  # [I]
    valid = group < e
    group = jnp.minimum(group, e - 1)
    tile = jnp.where(valid, first_tile[group] + items - first_item[group], 0)
    return tile, group, valid.astype(jnp.int32), first_tile, first_item


def combine(item_out, group_sizes, first_tile, first_item, m: int, tm: int,
            transposed: bool = False):
    """Rows from the items' outputs: item_out `[I, tm, N]` (transposed: `[I, N, tm]`, the
    Mosaic GPU kernel's) -> `[m, N]`.

    Row r of group g lies in tile r // tm, whose item for g is
    `first_item[g] + r // tm - first_tile[g]`; it is gathered from there (one source per row:
    exact and deterministic; one gather either way, no transpose of the items' outputs).
    Rows in no group are zeros.
    """
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))  # [E]
    rows = jnp.arange(m, dtype=jnp.int32)  # [m]
    # compare_all: E is small, and the default scan becomes a while loop on the GPU, outside
    # the step's CUDA graph (docs/gpu_step_report.md).
    g = jnp.searchsorted(ends, rows, side="right",
                         method="compare_all").astype(jnp.int32)  # [m]: E past the groups
    in_group = g < group_sizes.shape[0]
    g = jnp.minimum(g, group_sizes.shape[0] - 1)
    item = first_item[g] + rows // tm - first_tile[g]  # [m]
    if transposed:
        item = jnp.where(in_group, item, 0)
        out = item_out[item, :, rows % tm]  # [m, N]
    else:
        flat = item_out.reshape(-1, item_out.shape[-1])  # [I * tm, N]
        src = jnp.where(in_group, item * tm + rows % tm, 0)  # [m]
        out = jnp.take(flat, src, axis=0)  # [m, N]
    return jnp.where(in_group[:, None], out, 0.0)


def pad_rows(x, tm: int):
    """x `[M, K]` with zero rows appended up to whole tiles of tm rows."""
    m = x.shape[0]
    return jnp.pad(x, ((0, -(-m // tm) * tm - m), (0, 0)))  # [T * tm, K]


def check_arguments(x, w, group_sizes, scales):
    """Raises ValueError for arguments no grouped matmul takes (shapes, int8 codes and scales)."""
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped matmul takes x [M, K], w [E, K, N] (or int8 [E, N, K]) and "
                         f"group_sizes [E]; got {x.shape}, {w.shape}, {group_sizes.shape}")
    k = w.shape[2] if scales is not None else w.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weights contract {k}")
    if scales is not None:
        if w.dtype != jnp.int8 or scales.shape != (w.shape[0], w.shape[1]):
            raise ValueError(f"int8 weights take codes int8 [E, N, K] and scales [E, N]; got "
                             f"{w.dtype} {w.shape}, scales {scales.shape}")


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of 2 dividing n and at most cap (a block size)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def kernel_unsupported(k: int, n: int) -> str | None:
    """Why the Triton kernel cannot take a [K] x [N] projection (None: it can)."""
    if k % _MIN_DOT or n % _MIN_DOT:
        return f"K={k} and N={n} must be multiples of {_MIN_DOT} (Triton dot blocks)"
    return None


def _gmm_kernel(tile_ref, group_ref, valid_ref, x_ref, w_ref, *rest, tm, bk, num_k, int8,
                precision):
    """One item's [tm, bn] output block: tile rows of x times its group's weight columns.

    x_ref [T * tm, K] and w_ref [E, K, N] (int8: [E, N, K]) are whole arrays, indexed here by
    the item's tile and group; o_ref is the item's [tm, bn] block. Padding items do nothing
    (their block is never read).
    """
    s_ref, o_ref = rest if int8 else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[-1]

    @pl.when(valid_ref[i] != 0)
    def _():
        row0 = pl.multiple_of(tile_ref[i] * tm, tm)
        g = group_ref[i]
        n0 = pl.multiple_of(j * bn, bn)

        def step(s, acc):
            k0 = pl.multiple_of(s * bk, bk)
            xb = x_ref[pl.ds(row0, tm), pl.ds(k0, bk)]  # [tm, bk]
            if int8:
                wb = w_ref[g, pl.ds(n0, bn), pl.ds(k0, bk)].astype(xb.dtype)  # [bn, bk]
                dims = (((1,), (1,)), ((), ()))
            else:
                wb = w_ref[g, pl.ds(k0, bk), pl.ds(n0, bn)]  # [bk, bn]
                dims = (((1,), (0,)), ((), ()))
            return acc + lax.dot_general(xb, wb, dims, precision=precision,
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, num_k, step, jnp.zeros((tm, bn), jnp.float32))  # [tm, bn]
        if int8:
            acc = acc * s_ref[g, pl.ds(n0, bn)].astype(jnp.float32)[None, :]
        o_ref[...] = acc


def pick_tm(m: int, num_groups: int | None = None) -> int:
    """Kernel tile rows, a power of 2 in [16 (Triton's minimum), 64]. With num_groups: the
    mean rows of a group that has any (M over min(E, M)) rounded up, so that a typical group
    fills one tile (each item writes tm output rows: 64 experts at a batch-64 top-8 decode,
    8 rows each, take 16-row tiles, 4x fewer padded output bytes than 64); without (the LoRA
    kernel's slots): 16 for decode-sized M, 64 for prefill-sized. From the tile arithmetic
    (fewer re-reads of each group's weights in taller tiles, less padding in shorter ones),
    not measured on a GPU."""
    if num_groups is None:
        return _MIN_DOT if m <= _PREFILL_ROWS else 64
    m = max(m, 1)
    return min(64, max(_MIN_DOT, next_pow2(-(-m // min(num_groups, m)))))


@functools.partial(jax.jit, static_argnames=("tm", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(x, w, group_sizes, scales=None, *, tm=None, block_n=None, block_k=None,
                   num_warps=None, num_stages=None, interpret=False):
    """The Pallas kernel: x `[M, K]` (bf16/f32, rows sorted by group) @ w per group -> f32
    `[M, N]`. w `[E, K, N]` float (x's dtype), or int8 codes `[E, N, K]` with scales `[E, N]`.
    tm: tile rows (power of 2 >= 16; None: `pick_tm` for M and E); block_n/block_k: None
    picks the largest power of 2 dividing N (<= 128) / K (<= 64)."""
    check_arguments(x, w, group_sizes, scales)
    int8 = scales is not None
    m, k = x.shape
    n = w.shape[1] if int8 else w.shape[2]
    why = kernel_unsupported(k, n)
    if why:
        raise ValueError(f"grouped_matmul kernel: {why}")
    tm = tm or pick_tm(m, group_sizes.shape[0])
    bn = block_n or pow2_divisor(n, _MAX_BLOCK_N)
    bk = block_k or pow2_divisor(k, _MAX_BLOCK_K)
    for name, b, dim in (("tm", tm, None), ("block_n", bn, n), ("block_k", bk, k)):
        if b < _MIN_DOT or b & (b - 1) or (dim is not None and dim % b):
            raise ValueError(f"{name}={b} must be a power of 2 >= {_MIN_DOT}"
                             + (f" dividing {dim}" if dim is not None else ""))
    if not int8 and w.dtype != x.dtype:
        w = w.astype(x.dtype)
    if m == 0:
        return jnp.zeros((0, n), jnp.float32)
    tile, group, valid, first_tile, first_item = schedule(group_sizes, m, tm)
    xp = pad_rows(x, tm)  # [T * tm, K]
    items = tile.shape[0]

    def whole(a):
        return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)

    args = [tile, group, valid, xp, w] + ([scales] if int8 else [])
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_gmm_kernel, tm=tm, bk=bk, num_k=k // bk, int8=int8,
                               precision=precision)
    params = None
    if not interpret and (num_warps or num_stages):
        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    item_out = pl.pallas_call(
        kernel,
        grid=(items, n // bn),
        in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((None, tm, bn), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((items, tm, n), jnp.float32),  # [I, tm, N]
        compiler_params=params,
        interpret=interpret,
        name="grouped_matmul",
    )(*args)
    return combine(item_out, group_sizes, first_tile, first_item, m, tm)


@functools.partial(jax.jit, static_argnames=("tm",))
def grouped_matmul_tiled(x, w, group_sizes, scales=None, *, tm: int = 16):
    """The kernel's tiling in plain XLA (the CPU path): every item's rows and its group's
    weights gathered, one batched dot `[I, tm, K] x [I, K, N]` (padding items included: the
    shapes are static), and the rows combined. Same arguments and result as `grouped_matmul`;
    any tm >= 1."""
    check_arguments(x, w, group_sizes, scales)
    m = x.shape[0]
    if m == 0:
        return jnp.zeros((0, w.shape[1] if scales is not None else w.shape[2]), jnp.float32)
    tile, group, _, first_tile, first_item = schedule(group_sizes, m, tm)
    xt = pad_rows(x, tm).reshape(-1, tm, x.shape[1])[tile]  # [I, tm, K]
    if scales is None:
        wt = w[group].astype(x.dtype)  # [I, K, N]
        y = jnp.einsum("itk,ikn->itn", xt, wt, preferred_element_type=jnp.float32)
    else:
        wt = w[group].astype(x.dtype)  # [I, N, K]: int8 codes, exact in x's dtype
        y = jnp.einsum("itk,ink->itn", xt, wt, preferred_element_type=jnp.float32)
        y = y * scales[group].astype(jnp.float32)[:, None, :]
    return combine(y, group_sizes, first_tile, first_item, m, tm)  # [M, N]


def grouped_matmul_reference(x, w, group_sizes, scales=None):
    """Every row times every group's weights, the row's own kept: dense, for tests only.
    f32 products at HIGHEST precision; same arguments and result as `grouped_matmul`."""
    check_arguments(x, w, group_sizes, scales)
    f32 = jnp.float32
    wf = w.astype(f32)
    if scales is not None:
        wf = jnp.swapaxes(wf, 1, 2) * scales.astype(f32)[:, None, :]  # [E, K, N]
    every = jnp.einsum("mk,ekn->emn", x.astype(f32), wf, precision=lax.Precision.HIGHEST)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    g = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right", method="compare_all")  # [M]
    mask = g[None, :] == jnp.arange(w.shape[0])[:, None]  # [E, M]
    return jnp.sum(jnp.where(mask[..., None], every, 0.0), axis=0)  # [M, N]
