"""Multi-LoRA delta (Punica/S-LoRA "SGMV"): each row times its adapter's low-rank pair, shrink
and expand fused in one Pallas (Triton GPU) kernel; the same tiling in plain XLA; a reference.

    y[m] = (x[m] @ a[g(m)]) @ b[g(m)]
    x [M, K] rows sorted by group (adapter slot), a [S, K, R], b [S, R, N], group_sizes [S]

where rows `sum(sizes[:g]) .. sum(sizes[:g + 1]) - 1` belong to slot g; rows past
`sum(group_sizes)` belong to no adapter and give zeros. x, a and b are float32 or bfloat16 (a
and b are converted to x's dtype); products accumulate in float32. For bfloat16 the shrink's
`[rows, R]` result is rounded to bfloat16 before the expand (as Punica does); for float32 it
stays float32. The result is float32 `[M, N]`.

R is the engine's max_lora_rank (8..64); K and N are model widths. The tiling is the grouped
matmul's (pallas_kernels/grouped_matmul.py: `schedule`, `num_items`, `combine`): work item i
is one (row tile, slot) pair whose rows intersect, tm rows wide; rows in no slot make no
item. The kernel's program (i, j) loads item i's x tile, computes `h [tm, R] = x_tile @ a[g]`
over K blocks, then `h @ b[g]` for each N block of its share j of the columns into the item's
`[tm, N]` output block; each row then takes its result from its (tile, slot) item (`combine`).
Splitting the columns over programs recomputes the shrink per split (tm * K * R, tiny at
LoRA ranks, its operands in L2) to give decode-sized batches, which have few items, enough
programs for the SMs.

GPU (Triton) constraints: every dot dimension >= 16 and power-of-2 blocks: R is padded with
zeros to a power of 2 >= 16 here (exact), K and N must be multiples of 16 (`kernel_unsupported`;
the runtime takes the XLA path otherwise); f32 dots at IEEE precision (HIGHEST), not TF32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import NUM_SMS, next_pow2
from pallas_kernels.grouped_matmul import (combine, kernel_unsupported, pad_rows, pick_tm,
                                           pow2_divisor, schedule)

_MIN_DOT = 16            # Triton's dot wants every dimension >= 16
_MAX_BLOCK_N = 128
_MAX_BLOCK_K = 64

__all__ = ["kernel_unsupported", "lora_sgmv", "lora_sgmv_reference", "lora_sgmv_xla",
           "pick_splits", "padded_rank"]


def _check(x, a, b, group_sizes):
    if (x.ndim != 2 or a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]
            or group_sizes.shape != (a.shape[0],)):
        raise ValueError(f"lora_sgmv takes x [M, K], a [S, K, R], b [S, R, N] and group_sizes "
                         f"[S]; got {x.shape}, {a.shape}, {b.shape}, {group_sizes.shape}")
    if x.shape[1] != a.shape[1] or a.shape[2] != b.shape[1]:
        raise ValueError(f"shapes do not chain: x {x.shape} @ a {a.shape} @ b {b.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"lora_sgmv takes float32 or bfloat16 activations, got {x.dtype}")


def padded_rank(r: int) -> int:
    """The rank the kernel computes with: a power of 2 >= 16 (Triton dot blocks)."""
    return max(_MIN_DOT, next_pow2(r))


def _pad_rank(a, b, r: int):
    """a [S, K, R] and b [S, R, N] with zero rank columns/rows appended up to r (exact)."""
    extra = r - a.shape[2]
    if not extra:
        return a, b
    return (jnp.pad(a, ((0, 0), (0, 0), (0, extra))),   # [S, K, r]
            jnp.pad(b, ((0, 0), (0, extra), (0, 0))))   # [S, r, N]


def pick_splits(items: int, n_blocks: int) -> int:
    """Programs sharing one item's N blocks: the largest power of 2 dividing n_blocks and at
    most ceil(NUM_SMS / items), so a decode batch (a few items) still reaches every SM. A
    guess from the arithmetic (each split redoes a tm x K x R shrink), not measured on a GPU."""
    want = -(-NUM_SMS // max(items, 1))
    s = 1
    while s * 2 <= want and n_blocks % (s * 2) == 0:
        s *= 2
    return s


def _lora_kernel(tile_ref, group_ref, valid_ref, x_ref, a_ref, b_ref, o_ref, *, tm, bk, num_k,
                 bn, blocks_per_split, cast_h, precision):
    """Program (i, j): item i's shrink, then its N blocks of split j.

    x_ref [T * tm, K], a_ref [S, K, R] and b_ref [S, R, N] are whole arrays, indexed by the
    item's tile and slot; o_ref is the item's [tm, N] output block. Padding items do nothing
    (their block is never read)."""
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(valid_ref[i] != 0)
    def _():
        row0 = pl.multiple_of(tile_ref[i] * tm, tm)
        g = group_ref[i]
        dims = (((1,), (0,)), ((), ()))
        r = a_ref.shape[2]

        def shrink(s, acc):
            k0 = pl.multiple_of(s * bk, bk)
            xb = x_ref[pl.ds(row0, tm), pl.ds(k0, bk)]  # [tm, bk]
            ab = a_ref[g, pl.ds(k0, bk), :]  # [bk, R]
            return acc + lax.dot_general(xb, ab, dims, precision=precision,
                                         preferred_element_type=jnp.float32)

        h = lax.fori_loop(0, num_k, shrink, jnp.zeros((tm, r), jnp.float32))  # [tm, R]
        if cast_h:  # bf16: the expand takes h rounded to the input dtype (Punica's choice)
            h = h.astype(x_ref.dtype)

        def expand(s, carry):
            n0 = pl.multiple_of((j * blocks_per_split + s) * bn, bn)
            bb = b_ref[g, :, pl.ds(n0, bn)]  # [R, bn]
            o_ref[:, pl.ds(n0, bn)] = lax.dot_general(h, bb, dims, precision=precision,
                                                      preferred_element_type=jnp.float32)
            return carry

        lax.fori_loop(0, blocks_per_split, expand, 0)


@functools.partial(jax.jit, static_argnames=("tm", "block_n", "block_k", "splits", "num_warps",
                                             "num_stages", "interpret"))
def lora_sgmv(x, a, b, group_sizes, *, tm=None, block_n=None, block_k=None, splits=None,
              num_warps=None, num_stages=None, interpret=False):
    """The Pallas kernel: x `[M, K]` (bf16/f32, rows sorted by slot), a `[S, K, R]`,
    b `[S, R, N]`, group_sizes `[S]` int -> f32 `[M, N]` (module docstring).
    tm: tile rows (power of 2 >= 16; None: grouped_matmul's `pick_tm`); block_n/block_k: None
    picks the largest power of 2 dividing N (<= 128) / K (<= 64); splits: programs per item
    along N (None: `pick_splits`)."""
    _check(x, a, b, group_sizes)
    m, k = x.shape
    n = b.shape[2]
    why = kernel_unsupported(k, n)
    if why:
        raise ValueError(f"lora_sgmv kernel: {why}")
    tm = tm or pick_tm(m)
    bn = block_n or pow2_divisor(n, _MAX_BLOCK_N)
    bk = block_k or pow2_divisor(k, _MAX_BLOCK_K)
    for name, blk, dim in (("tm", tm, None), ("block_n", bn, n), ("block_k", bk, k)):
        if blk < _MIN_DOT or blk & (blk - 1) or (dim is not None and dim % blk):
            raise ValueError(f"{name}={blk} must be a power of 2 >= {_MIN_DOT}"
                             + (f" dividing {dim}" if dim is not None else ""))
    if m == 0:
        return jnp.zeros((0, n), jnp.float32)
    a, b = _pad_rank(a.astype(x.dtype), b.astype(x.dtype), padded_rank(a.shape[2]))
    tile, group, valid, first_tile, first_item = schedule(group_sizes, m, tm)
    xp = pad_rows(x, tm)  # [T * tm, K]
    items, n_blocks = tile.shape[0], n // bn
    splits = splits or pick_splits(items, n_blocks)
    if n_blocks % splits:
        raise ValueError(f"splits={splits} must divide the {n_blocks} blocks of {bn} columns")

    def whole(arr):
        return pl.BlockSpec(arr.shape, lambda *_: (0,) * arr.ndim)

    args = [tile, group, valid, xp, a, b]
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_lora_kernel, tm=tm, bk=bk, num_k=k // bk, bn=bn,
                               blocks_per_split=n_blocks // splits,
                               cast_h=x.dtype != jnp.float32, precision=precision)
    params = None
    if not interpret and (num_warps or num_stages):
        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    item_out = pl.pallas_call(
        kernel,
        grid=(items, splits),
        in_specs=[whole(arr) for arr in args],
        out_specs=pl.BlockSpec((None, tm, n), lambda i, j: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((items, tm, n), jnp.float32),  # [I, tm, N]
        compiler_params=params,
        interpret=interpret,
        name="lora_sgmv",
    )(*args)
    return combine(item_out, group_sizes, first_tile, first_item, m, tm)


@functools.partial(jax.jit, static_argnames=("tm",))
def lora_sgmv_xla(x, a, b, group_sizes, *, tm: int = 16):
    """The kernel's tiling in plain XLA (the path for shapes the kernel cannot tile, and for
    CPUs): every item's rows and its slot's a and b gathered, two batched dots (padding items
    included: the shapes are static), the rows combined. Same arguments and result as
    `lora_sgmv`; any K, N, R and tm >= 1."""
    _check(x, a, b, group_sizes)
    m = x.shape[0]
    if m == 0:
        return jnp.zeros((0, b.shape[2]), jnp.float32)
    tile, group, _, first_tile, first_item = schedule(group_sizes, m, tm)
    xt = pad_rows(x, tm).reshape(-1, tm, x.shape[1])[tile]  # [I, tm, K]
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    h = jnp.einsum("itk,ikr->itr", xt, a[group].astype(x.dtype), precision=precision,
                   preferred_element_type=jnp.float32)  # [I, tm, R]
    y = jnp.einsum("itr,irn->itn", h.astype(x.dtype), b[group].astype(x.dtype),
                   precision=precision, preferred_element_type=jnp.float32)  # [I, tm, N]
    return combine(y, group_sizes, first_tile, first_item, m, tm)  # [M, N]


@jax.jit
def lora_sgmv_reference(x, a, b, group_sizes):
    """Each row's slot spelled out (jnp.repeat), its a and b gathered per row: for tests only.
    f32 products at HIGHEST precision; bf16 inputs get h rounded to bf16 as the contract says.
    Same arguments and result as `lora_sgmv`."""
    _check(x, a, b, group_sizes)
    m, s = x.shape[0], a.shape[0]
    f32 = jnp.float32
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    rest = jnp.maximum(m - jnp.sum(sizes), 0)[None]  # rows in no slot: slot S
    slot = jnp.repeat(jnp.arange(s + 1), jnp.concatenate([sizes, rest]),
                      total_repeat_length=m)  # [M]
    in_slot = slot < s
    slot = jnp.minimum(slot, s - 1)
    hp = lax.Precision.HIGHEST
    h = jnp.einsum("mk,mkr->mr", x.astype(f32), a.astype(x.dtype).astype(f32)[slot],
                   precision=hp)  # [M, R]
    h = h.astype(x.dtype).astype(f32)  # bf16: the rounding the contract asks for
    y = jnp.einsum("mr,mrn->mn", h, b.astype(x.dtype).astype(f32)[slot], precision=hp)  # [M, N]
    return jnp.where(in_slot[:, None], y, 0.0)
