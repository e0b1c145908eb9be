"""Grouped matmul (the MoE experts' projections) for Hopper in Pallas Mosaic GPU.

Same contract, schedule and reference as the Triton kernel (pallas_kernels/grouped_matmul.py,
whose docstring gives the tiling): rows sorted by group, y[r] = x[r] @ w[g(r)], float weights
`[E, K, N]` or int8 codes `[E, N, K]` with per-(group, output channel) scales `[E, N]`, f32
results `[M, N]`, rows in no group zeros. The work items (one row tile and one group whose
rows meet) come from the same on-device `schedule`, and rows are gathered back by the same
`combine`: no accumulation across items, so exact and deterministic.

Orientation (as pallas_kernels/int4_matmul_mgpu.py): a program computes one item's output
transposed, `[64 columns, tm rows] = W[g]^T x^T`. wgmma's M side is 64 rows a warpgroup: the
weight columns take it, and the item's rows take wgmma's N side, which needs only a multiple
of 8, so a decode-sized item (a few rows of an expert) pads to 8 or 16 rows, not 64. The
`[I, N, tm]` item outputs are gathered back into rows by `combine` (one gather, no transpose).

Grid (N / 64 column blocks, items). A program reads its item's (tile, group, valid) from one
128-byte metadata row (a TMA into SMEM: Lane-semantics copies move multiples of 128 bytes),
then pipelines (`plgpu.emit_pipeline`) over K in steps of 64: a TMA of the x tile `[tm, 64]`
(rows `tile * tm ..`, a multiple of 8, of x padded to whole tiles) and of the weight tile,
both into 128-byte-swizzled SMEM, and one wgmma into a `[64, tm]` f32 accumulator. Float
weights: the tile `[64 (K), 64 (N)]` of `w[g]` is wgmma's A operand transposed; the wgmma
runs while the next step's copies land (the slot is released one step late). int8 codes: the
tile `[64 (N), 64 (K)]` of `w[g]` lands as int8, is converted in registers to x's dtype
(exact: |code| <= 127) into an SMEM tile of that dtype, and the wgmma waits before that tile is
written again; the group's 64 scales come by one more TMA and multiply the accumulator's rows
in f32, as the Triton kernel applies them. Padding items (past the schedule's valid ones)
return at once; their output blocks are never read.

Supported: bf16 or f16 activations (f32 would run as TF32 on wgmma, not the reference's IEEE
products: refused, the Triton kernel runs it), float weights of x's dtype or int8 codes, K and
N multiples of 64 (`unsupported`). Work: every valid item streams its group's `[K, 64]`
slice per column block; a group spread over several row tiles is read once per tile (from L2
after the first, when the programs run together).

What only a GPU run can show: speed (the pipeline depth, the int8 conversion on the single
warpgroup's path, L2 reuse of a group's weights across its tiles) and whether 132 SMs are
kept busy at decode. Interpret mode with race detection and the deviceless sm_90a compile
check the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import check_arguments, combine, num_items, pad_rows, schedule

BLOCK_N = 64       # wgmma's M side per warpgroup: output columns per program
BLOCK_K = 64       # K per pipeline step: one 128-byte swizzle row of 16-bit values
META_W = 32        # int32 per item's metadata row: 128 bytes, a whole TMA
MAX_TM = 128       # rows per item (wgmma's N side)
MAX_STAGES = 4     # pipeline buffers
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported(k: int, n: int, dtype, w_dtype=None) -> str | None:
    """Why the Mosaic GPU kernel cannot run [K] x [N] projections with activations of `dtype`
    and weights of `w_dtype` (None: dtype; int8: codes with scales), or None if it can."""
    dtype = jnp.dtype(dtype)
    w_dtype = dtype if w_dtype is None else jnp.dtype(w_dtype)
    if dtype not in _DTYPES:
        return (f"activations must be bfloat16 or float16 (wgmma would run {dtype.name} as "
                f"TF32), got {dtype.name}")
    if w_dtype not in (dtype, jnp.dtype(jnp.int8)):
        return f"weights must be {dtype.name} or int8 codes, got {w_dtype.name}"
    if k % BLOCK_K or n % BLOCK_N:
        return (f"K={k} and N={n} must be multiples of {BLOCK_K} (a pipeline step's 128-byte "
                f"swizzled rows; wgmma's 64 rows per warpgroup)")
    return None


def pick_tm(m: int, num_groups: int) -> int:
    """Rows per item: the mean rows of a group that has any (M over min(E, M)), rounded up to
    a multiple of 8 and at most 128, so that a typical group fills one tile: each item writes
    tm output rows, most of them padding when tm is far above the group's rows (64 experts
    at a batch-64 top-8 decode: 8 rows a group, 8x fewer output bytes than 64-row tiles),
    and a group spread over many tiles streams its weights once per tile. From this
    arithmetic, not measured on a GPU."""
    m = max(m, 1)
    rows = -(-m // min(num_groups, m))
    return min(MAX_TM, -(-rows // 8) * 8)


def _stages(k: int) -> int:
    return min(MAX_STAGES, k // BLOCK_K)


def cost(m: int, num_groups: int, k: int, n: int, int8: bool = False,
         tm: int | None = None) -> dict:
    """HBM bytes (read + written), FLOPs and launches of one call at the default tiling:
    the weights of at most min(E, M) groups (each row has one; a group spread over several
    tiles is re-read from L2, not counted), x padded to whole tiles, the scales, the schedule,
    and the `[I, N, tm]` item outputs written and gathered back into `[M, N]` f32."""
    tm = tm or pick_tm(m, num_groups)
    items = num_items(m, num_groups, tm)
    w_bytes = 1 if int8 else 2
    weights = min(num_groups, m) * k * n * w_bytes + (4 * num_groups * n if int8 else 0)
    xp = -(-m // tm) * tm * k * 2
    prep = 2 * m * k + xp + 4 * META_W * items      # pad x, write the metadata
    outputs = 4 * items * n * tm
    gather = outputs + 4 * m * n
    return dict(bytes=weights + prep + xp + outputs + gather, flops=2 * m * k * n,
                launches=3)


def grouped_matmul_mgpu_kernel(meta_ref, x_ref, w_ref, *refs, tm: int, int8: bool,
                               stages: int):
    """One item's `[64, tm]` output columns block (module docstring). Refs: metadata
    `[I, 32]`, padded x `[T * tm, K]`, w `[E, K, N]` (int8: `[E, N, K]` and scales `[E, N]`),
    the output `[I, N, tm]`, then the scratch."""
    if int8:
        s_ref, out_ref, meta_smem, out_smem, bars, s_smem, wb_smem = refs
    else:
        out_ref, meta_smem, out_smem, bars = refs
    j, i = lax.axis_index("n"), lax.axis_index("i")
    plgpu.copy_gmem_to_smem(meta_ref.at[i], meta_smem, bars.at[0])
    plgpu.barrier_wait(bars.at[0])
    tile, group, valid = meta_smem[0], meta_smem[1], meta_smem[2]
    cols = pl.ds(j * BLOCK_N, BLOCK_N)
    num_k = x_ref.shape[1] // BLOCK_K
    swizzled = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))

    @pl.when(valid != 0)
    def _():
        if int8:  # the group's scales, needed only after the pipeline
            plgpu.copy_gmem_to_smem(s_ref.at[group, cols], s_smem, bars.at[1])
        rows = x_ref.at[pl.ds(pl.multiple_of(tile * tm, 8), tm)]  # [tm, K]
        release = 1 if stages > 1 and not int8 else 0
        x_spec = plgpu.BlockSpec((tm, BLOCK_K), lambda t: (0, t), transforms=swizzled,
                                 delay_release=release)

        def float_step(acc_ref, _, x_smem, w_smem):
            # w_smem [64 (K), 64 (N)]: transposed, wgmma's A [64 (N), 64 (K)].
            plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)
            plgpu.wgmma_wait(release)  # at most this step's in flight when the last slot frees

        def int8_step(acc_ref, _, x_smem, w8_smem):
            codes = plgpu.load(w8_smem, layout=plgpu.Layout.WGMMA)  # [64 (N), 64 (K)]
            wb_smem[...] = codes.astype(wb_smem.dtype)
            plgpu.commit_smem()  # the stores, visible to wgmma (the async proxy)
            plgpu.wgmma(acc_ref, wb_smem, x_smem.T)
            plgpu.wgmma_wait(0)  # wb_smem is written again next step

        def product(acc_ref):
            if int8:
                w = w_ref.at[group, cols]  # [64, K] int8 codes
                w_spec = plgpu.BlockSpec(
                    (BLOCK_N, BLOCK_K), lambda t: (0, t),
                    transforms=(plgpu.TilingTransform((8, BLOCK_K)),
                                plgpu.SwizzleTransform(BLOCK_K)))
                body = int8_step
            else:
                w = w_ref.at[group, :, cols]  # [K, 64]
                w_spec = plgpu.BlockSpec((BLOCK_K, BLOCK_N), lambda t: (t, 0),
                                         transforms=swizzled, delay_release=release)
                body = float_step
            plgpu.emit_pipeline(functools.partial(body, acc_ref), grid=(num_k,),
                                in_specs=[x_spec, w_spec],
                                max_concurrent_steps=stages)(rows, w)
            return acc_ref[...]  # waits for the last wgmma

        acc = pl.run_scoped(product, plgpu.ACC((BLOCK_N, tm), jnp.float32))  # [64, tm]
        if int8:
            plgpu.barrier_wait(bars.at[1])
            scales = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [64]
            acc = acc * lax.broadcast_in_dim(scales, acc.shape, [0])
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[i, cols])
        plgpu.wait_smem_to_gmem(0)


def _meta(tile, group, valid):
    """`[I, 32]` int32: each item's tile, group and valid flag, zero-padded to 128 bytes."""
    meta = jnp.stack([tile, group, valid], axis=1).astype(jnp.int32)  # [I, 3]
    return jnp.pad(meta, ((0, 0), (0, META_W - 3)))


@functools.partial(jax.jit, static_argnames=("tm", "interpret"))
def grouped_matmul_mgpu(x, w, group_sizes, scales=None, *, tm=None, interpret=False):
    """The Mosaic GPU kernel: x `[M, K]` (bf16/f16, rows sorted by group) @ w per group ->
    f32 `[M, N]`. w `[E, K, N]` of x's dtype, or int8 codes `[E, N, K]` with scales `[E, N]`
    (any float dtype). tm: rows per item (a multiple of 8 up to 128; None: `pick_tm`).
    interpret: False on a Hopper GPU, or `plgpu.InterpretGPUParams(...)` to run on CPU.
    Raises ValueError for what `unsupported` refuses."""
    check_arguments(x, w, group_sizes, scales)
    int8 = scales is not None
    m, k = x.shape
    n = w.shape[1] if int8 else w.shape[2]
    why = unsupported(k, n, x.dtype, w.dtype)
    if why:
        raise ValueError(f"grouped_matmul_mgpu: {why}")
    tm = tm or pick_tm(m, group_sizes.shape[0])
    if tm % 8 or not 8 <= tm <= MAX_TM:
        raise ValueError(f"tm={tm} must be a multiple of 8 in [8, {MAX_TM}] (wgmma's N side)")
    if m == 0:
        return jnp.zeros((0, n), jnp.float32)
    tile, group, valid, first_tile, first_item = schedule(group_sizes, m, tm)
    meta = _meta(tile, group, valid)  # [I, 32]
    xp = pad_rows(x, tm)  # [T * tm, K]
    items = tile.shape[0]
    stages = _stages(k)
    kernel = functools.partial(grouped_matmul_mgpu_kernel, tm=tm, int8=int8, stages=stages)
    # The compiled program names the custom call by its body (a partial is 'anonymous').
    kernel.__name__ = kernel.func.__name__
    scratch = [plgpu.SMEM((META_W,), jnp.int32), plgpu.SMEM((BLOCK_N, tm), jnp.float32),
               plgpu.Barrier(num_barriers=2)]
    if int8:
        scratch += [plgpu.SMEM((BLOCK_N,), jnp.float32),
                    plgpu.SMEM((BLOCK_N, BLOCK_K), x.dtype,
                               transforms=(plgpu.TilingTransform((8, BLOCK_K)),
                                           plgpu.SwizzleTransform(128)))]
    args = [meta, xp, w] + ([scales.astype(jnp.float32)] if int8 else [])
    item_out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((items, n, tm), jnp.float32),  # [I, N, tm]
        grid=(n // BLOCK_N, items), grid_names=("n", "i"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*args)
    return combine(item_out, group_sizes, first_tile, first_item, m, tm, transposed=True)
