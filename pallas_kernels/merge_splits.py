"""The combine of a split attention's partial results: one Pallas Triton kernel, and its
jax.numpy reference.

When several programs share one row's pages (ragged_paged_attention.py's splits: decode steps
with too few rows to fill the GPU), each leaves a normalised partial output with its running
max and sum. XLA runs the jax.numpy combine as three kernels (the weights, the weighted sum,
the cast to the activations' dtype); at batch 1 each costs more in launch and ramp than in
bytes (docs/perf_model.md), so the GPU step merges in one kernel that also writes the
activations' dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import MASK_VALUE, MIN_DOT_ROWS, load_rows, store_rows

BLOCK_ROWS = MIN_DOT_ROWS  # rows a program merges


def merge_splits_reference(o, m, l):
    """The output `[N, Dh]` f32 from S partial ones `[S, N, Dh]` (max, sum `[S, N]`): each
    split's normalised output weighted by its share of the softmax mass."""
    w = l * jnp.exp(m - m.max(axis=0))  # [S, N]; empty splits have l = 0
    total = w.sum(axis=0)
    return (o * w[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, splits: int, rows: int):
    """o_ref `[S * N, Dh]`, m_ref / l_ref `[S * N]` f32; out_ref `[N, Dh]`. Program i: rows
    i * BLOCK_ROWS ..; the splits are unrolled (S <= 16)."""
    r = pl.program_id(0) * BLOCK_ROWS + lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0)
    ok = r < rows
    head_dim = o_ref.shape[1]

    def vec(ref, s, other):
        return plgpu.load(ref.at[jnp.where(ok, s * rows + r, 0)], mask=ok, other=other)

    ms = [vec(m_ref, s, MASK_VALUE) for s in range(splits)]
    top = functools.reduce(jnp.maximum, ms)  # [bn]
    acc = jnp.zeros((BLOCK_ROWS, head_dim), jnp.float32)
    total = jnp.zeros((BLOCK_ROWS,), jnp.float32)
    for s in range(splits):
        w = vec(l_ref, s, 0.0) * jnp.exp(ms[s] - top)  # [bn]; empty splits have l = 0
        o = load_rows(o_ref, s * rows + r, ok, head_dim)  # [bn, Dh]
        acc, total = acc + w[:, None] * o, total + w
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    store_rows(out_ref, r, ok, out.astype(out_ref.dtype))


def merge_splits(o, m, l, *, out_dtype, interpret=False):
    """merge_splits_reference's result `[N, Dh]` in `out_dtype`, in one kernel. o `[S, N, Dh]`
    f32 (Dh a power of 2), m and l `[S, N]` f32. interpret: as the attention kernel's."""
    splits, rows, head_dim = o.shape
    if m.shape != (splits, rows) or l.shape != (splits, rows) or head_dim & (head_dim - 1):
        raise ValueError(f"merge_splits takes o [S, N, Dh] (Dh a power of 2) and m, l [S, N], "
                         f"got {o.shape}, {m.shape}, {l.shape}")
    args = (o.reshape(splits * rows, head_dim), m.reshape(-1), l.reshape(-1))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)

    return pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, rows=rows),
        grid=(pl.cdiv(rows, BLOCK_ROWS),),
        in_specs=[whole(x) for x in args],
        out_specs=pl.BlockSpec((rows, head_dim), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, head_dim), out_dtype),  # [N, Dh]
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="merge_splits",
    )(*args)
