"""W4A16 matmul (int4 weights, bf16/f16 activations) for Hopper in Pallas Mosaic GPU.

Reads the weight format of `pallas_kernels/int4_matmul.py` (see its docstring): packed
[K/2, N] uint8 with per-group-halves nibbles, scales [K/g, N] and offsets [K/g, N] (or None:
symmetric, w = s * (u - 8)) in any float dtype. Checked against the same
`int4_matmul_reference`.

Orientation: the kernel computes out^T = W^T x^T. wgmma's M side is fixed at 64 rows per
warpgroup; putting the weight there (64 output columns per program) lets the activations take
wgmma's N side, which only needs a multiple of 8. Decode (M = 1..8) pads to 8 rows, not 64, so
the tensor cores do 8x less padded work than x @ W would (at M = 1 with x @ W, an 8B GEMM's
padded tensor work takes about as long as streaming its weights). M is padded to a multiple of
8 and tiled in blocks of at most 64 (`block_m`).

Tiling: a program owns 64 output columns (`block_n`) for one M block and one K split. It
pipelines (`plgpu.emit_pipeline`, 2 buffers) over K tiles of 128 rows: a TMA brings 64 packed
rows [64, 64] uint8, the x tile [Mp, 128] bf16, and the tile's scales, offsets and activation
sums. The packed tile is the smallest that loads into registers in the WGMMA layout (64 rows).

K % 128 == 64 (SmolLM2's d_model 576 = 4.5 tiles): the last 64 K rows are one more split of
their own (`_tail`), whose single step loads the full tile ending at K, rows K-128 .. K-1 (the
previous tile's second half again, from L2), and multiplies only its groups in rows 64..127.
As g <= 64 divides K, K-128 starts a group and that tile's second half holds whole groups, both
halves of each in its packed rows 32..63 (per-group halves). So every TMA and register load
keeps the 64-packed-row shape and never reads past K or reads unwritten SMEM; the cost is one
half tile loaded and dequantised for nothing per 64-column block. K must be a multiple of 64
and at least 128 (`unsupported`).

Dequantisation: one load of the packed tile; each byte's low and high nibble OR-ed into 0x4300
are the bf16 128 + u, exact, with no integer-to-float conversion (the Triton kernel's trick).
The low nibbles go to rows 0..63 of a bf16 [128, 64] SMEM tile, the high nibbles to rows
64..127; group G of the tile is then rows G*g/2 (low half) and 64 + G*g/2 (high half), each
g/2 long, matched with x's columns G*g .. G*g + g/2 and G*g + g/2 .. (G+1)*g. The transposed
SMEM tile is wgmma's A operand, x's SMEM tile (transposed) its B.

Scales after the dot: each group's dot goes to a fresh accumulator (exact products, f32 sums),
then acc += s * d + xs * (b - 128 s), with xs the group's activation sums (computed in the
wrapper) and the symmetric b = -8 s. So no weight is ever rounded to bf16: the only bf16
rounding is the output's, as in the Triton kernel, and the tests hold to the same tolerances.
The per-group accumulator is [64, Mp] f32 (4 registers a thread at Mp = 8), so the per-group
read-out is cheap at decode.

Swizzle: wgmma needs both operands' swizzle equal and K slices aligned to the swizzle tile, so
the SMEM tiles use a swizzle of g bytes (g/2 bf16 per row: 128 B at g = 128, 64 B at g = 64,
32 B at g = 32).

Split-K: decode GEMMs have few 64-column blocks (64 at N = 4096), so K tiles are split to reach
>= 132 programs (one per H200 SM); f32 partials [split (+ 1 for a tail), N, Mp] are summed by the
wrapper.

Launches: the wrapper pads x and sums its groups (one XLA fusion), the kernel, then one fusion
that sums the splits, transposes and casts.

What only a GPU run can show: speed (the pipeline depth, whether one warpgroup per program hides
the dequantisation behind the TMA, the bank conflicts of the swizzled stores) and whether the
tensor cores' f32 accumulation meets the tolerance; interpret mode and the deviceless sm_90a
compile check the rest. Not done yet: warp specialisation (a producer warpgroup), two compute
warpgroups per program, and unpacking two codes per 32-bit operation as the Triton kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_NUM_SMS = 132      # H200
_BLOCK_N = 64       # wgmma M: output columns per program (one warpgroup)
_TILE_K = 128       # K rows per pipeline step: 64 packed rows, the WGMMA layout's row count
_HALF_TILE_K = 64   # a K % 128 == 64 tail, run as one extra split (see `_tail`)
_MAX_BLOCK_M = 64   # activation rows per program (wgmma N); [64, 64] f32 accumulators
_GROUPS = (32, 64, 128)
_MAGIC = {jnp.dtype(jnp.bfloat16): 0x4300, jnp.dtype(jnp.float16): 0x6400}  # 2^p as bits
_BIAS = {jnp.dtype(jnp.bfloat16): 128.0, jnp.dtype(jnp.float16): 1024.0}


def unsupported(m: int, k: int, n: int, group_size: int, dtype) -> str | None:
    """Why `int4_matmul_mgpu` cannot run [m, k] x [k, n] with this group size and activation
    dtype, or None if it can."""
    dtype = jnp.dtype(dtype)
    if dtype not in _MAGIC:
        return (f"activations must be bfloat16 or float16 (wgmma takes 16-bit operands and the "
                f"codes are exact in them), got {dtype}")
    if m < 1:
        return f"M must be >= 1, got {m}"
    if group_size not in _GROUPS:
        return f"group_size must be one of {_GROUPS}, got {group_size}"
    if k % group_size:
        return f"K={k} must be a multiple of group_size={group_size}"
    if k % _HALF_TILE_K or k < _TILE_K:
        return (f"K={k} must be a multiple of {_HALF_TILE_K} and at least {_TILE_K}: a pipeline "
                f"step loads 64 packed rows, the fewest that load in the WGMMA register layout, "
                f"and a last half tile is read as the last full one")
    if n % _BLOCK_N:
        return f"N={n} must be a multiple of {_BLOCK_N} (wgmma's M side per warpgroup)"
    return None


def _block_m(m: int) -> int:
    return min(_MAX_BLOCK_M, -(-m // 8) * 8)


def _tail(k: int) -> bool:
    """Whether K ends in a half tile (K % 128 == 64), run by one more split of its own."""
    return k % _TILE_K != 0


def pick_split(m: int, k: int, n: int, block_m: int | None = None) -> int:
    """K splits over the full K tiles (a divisor of their count): the fewest giving >= 132
    programs, else all. A half-tile tail adds one split (program) more (`_tail`)."""
    tiles = k // _TILE_K
    blocks = -(-m // (block_m or _block_m(m))) * (n // _BLOCK_N)
    tail = int(_tail(k))
    divisors = [s for s in range(1, tiles + 1) if tiles % s == 0]
    return next((s for s in divisors if blocks * (s + tail) >= _NUM_SMS), divisors[-1])


def cost(m: int, k: int, n: int, group_size: int) -> dict:
    """HBM bytes (read + written), FLOPs and launches of one call at the default tiling, with
    the engine's bf16 activations, scales and offsets (offsets counted; symmetric reads less).
    Split-K partials are counted written and read once, although at decode they stay in L2.
    A K % 128 == 64 tail's re-read of the previous half tile is L2's, so not counted."""
    bm = _block_m(m)
    mp = -(-m // bm) * bm
    split = pick_split(m, k, n, bm) + _tail(k)  # partials written
    m_blocks = mp // bm
    groups = k // group_size
    weights = m_blocks * (k * n // 2 + 2 * 2 * groups * n)  # each M block re-reads them
    prep = 2 * m * k + 2 * mp * k + 4 * groups * mp          # read x, write padded x and sums
    # Every 64-column block re-reads x and its sums, from the 50 MB L2: HBM sees them once.
    kernel_x = 2 * mp * k + 4 * groups * mp
    partials = 4 * split * n * mp
    epilogue = partials + 2 * m * n
    return dict(bytes=weights + prep + kernel_x + partials + epilogue, flops=2 * m * k * n,
                launches=3)


def int4_matmul_mgpu_kernel(*refs, group_size, block_m, tiles_per_split, splits, tail,
                            symmetric, dtype):
    if symmetric:
        x_ref, xs_ref, p_ref, s_ref, out_ref, w_smem, out_smem = refs
        o_ref = None
    else:
        x_ref, xs_ref, p_ref, s_ref, o_ref, out_ref, w_smem, out_smem = refs
    g, half = group_size, group_size // 2
    groups_per_tile = _TILE_K // g
    j, i, sk = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    magic, bias = _MAGIC[jnp.dtype(dtype)], _BIAS[jnp.dtype(dtype)]
    row = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector along the accumulator's rows (N)
    col = plgpu.Layout.WGMMA.reduce(0)  # a [block_m] vector along its columns (M)

    def step(first_group, _, x_smem, xs_smem, p_smem, s_smem, *rest):
        *o_smem, acc = rest
        grps = range(first_group, groups_per_tile)
        p = p_smem[...].astype(jnp.uint16)                              # [64, 64]
        s = [plgpu.load(s_smem.at[grp], layout=row).astype(jnp.float32) for grp in grps]  # [64]
        if symmetric:
            b = [-(bias + 8.0) * s_g for s_g in s]
        else:
            b = [plgpu.load(o_smem[0].at[grp], layout=row).astype(jnp.float32) - bias * s_g
                 for grp, s_g in zip(grps, s)]
        xs = [plgpu.load(xs_smem.at[grp], layout=col) for grp in grps]  # [bm]
        w_smem[pl.ds(0, 64), :] = lax.bitcast_convert_type((p & 0xF) | magic, dtype)
        w_smem[pl.ds(64, 64), :] = lax.bitcast_convert_type((p >> 4) | magic, dtype)
        # Makes the generic-proxy stores visible to wgmma (async proxy), and orders this step's
        # reads of the slot (all above) before the pipeline's TMA refill of it, two steps on.
        plgpu.commit_smem()
        for n_g, grp in enumerate(grps):
            def dot(d_ref, grp=grp):
                for h in range(2):  # low nibbles x first half of the group, high x second
                    plgpu.wgmma(d_ref, w_smem.at[pl.ds(64 * h + grp * half, half), :].T,
                                x_smem.at[:, pl.ds(grp * g + h * half, half)].T)
                return d_ref[...]  # waits for the wgmmas: w_smem is free after the loop
            d = pl.run_scoped(dot, plgpu.ACC((_BLOCK_N, block_m), jnp.float32))  # [64, bm]
            acc = acc + s[n_g][:, None] * d + b[n_g][:, None] * xs[n_g][None, :]
        return acc

    cols, m_rows = pl.ds(j * _BLOCK_N, _BLOCK_N), pl.ds(i * block_m, block_m)
    swizzle = g  # bytes: g/2 16-bit values, the K slice of one wgmma
    x_tr = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def partial_sum(k0, p0, grp0, tiles, first_group):
        """Pipelines over `tiles` K tiles from K row k0 (packed row p0, group grp0: a traced k0
        is not divided in the kernel); stores the [64, bm] partial sum as split `sk`."""
        k_rows, p_rows = pl.ds(k0, tiles * _TILE_K), pl.ds(p0, tiles * _TILE_K // 2)
        grp_rows = pl.ds(grp0, tiles * groups_per_tile)
        specs = [plgpu.BlockSpec((block_m, _TILE_K), lambda t: (0, t), transforms=x_tr),
                 plgpu.BlockSpec((groups_per_tile, block_m), lambda t: (t, 0)),
                 plgpu.BlockSpec((_TILE_K // 2, _BLOCK_N), lambda t: (t, 0)),
                 plgpu.BlockSpec((groups_per_tile, _BLOCK_N), lambda t: (t, 0))]
        args = [x_ref.at[m_rows, k_rows], xs_ref.at[grp_rows, m_rows],
                p_ref.at[p_rows, cols], s_ref.at[grp_rows, cols]]
        if not symmetric:
            specs.append(plgpu.BlockSpec((groups_per_tile, _BLOCK_N), lambda t: (t, 0)))
            args.append(o_ref.at[grp_rows, cols])
        acc0 = plgpu.layout_cast(jnp.zeros((_BLOCK_N, block_m), jnp.float32),
                                 plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(functools.partial(step, first_group), grid=(tiles,),
                                  in_specs=specs, max_concurrent_steps=2,
                                  init_carry=acc0)(*args)
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[sk, cols, m_rows])
        plgpu.wait_smem_to_gmem(0)

    t0 = sk * tiles_per_split
    full = functools.partial(partial_sum, t0 * _TILE_K, t0 * (_TILE_K // 2), t0 * groups_per_tile,
                             tiles_per_split, 0)
    if not tail:
        full()
        return
    pl.when(sk < splits)(full)
    # The last 64 K rows: the tile ending at K (so the previous tile's last 64 rows, again),
    # keeping only its groups past row 64. Every load keeps its 64-packed-row shape.
    k0 = x_ref.shape[1] - _TILE_K
    pl.when(sk == splits)(
        functools.partial(partial_sum, k0, k0 // 2, k0 // g, 1, groups_per_tile // 2))


def _check(x, packed, scales, offsets, group_size, block_m, block_n, block_k, split_k):
    m, k = x.shape
    n = packed.shape[1]
    reason = unsupported(m, k, n, group_size, x.dtype)
    if reason:
        raise ValueError(reason)
    if packed.shape != (k // 2, n) or packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8 [{k // 2}, N], got {packed.dtype} {packed.shape}")
    for name, a in (("scales", scales), ("offsets", offsets)):
        if a is not None and a.shape != (k // group_size, n):
            raise ValueError(f"{name} must be [{k // group_size}, {n}], got {a.shape}")
    if block_m is not None and not (block_m % 8 == 0 and 8 <= block_m <= 256):
        raise ValueError(f"block_m {block_m} must be a multiple of 8 in [8, 256] (wgmma's N)")
    if block_n not in (None, _BLOCK_N):
        raise ValueError(f"block_n must be {_BLOCK_N} (one warpgroup's wgmma M), got {block_n}")
    if block_k not in (None, _TILE_K):
        raise ValueError(f"block_k must be {_TILE_K} (64 packed rows), got {block_k}")
    if split_k is not None and (split_k < 1 or (k // _TILE_K) % split_k):
        raise ValueError(f"split_k {split_k} must divide the {k // _TILE_K} full K tiles")


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "block_k",
                                             "split_k", "interpret"))
def int4_matmul_mgpu(x, packed, scales, offsets, *, group_size: int, block_m=None,
                     block_n=None, block_k=None, split_k=None, interpret=False) -> jax.Array:
    """x @ dequantize(packed, scales, offsets) with f32 accumulation; see the module docstring.

    x       [M, K] bf16 or f16 activations (any M >= 1; padded inside)
    packed  [K // 2, N] uint8, two codes per byte, per-group halves layout
    scales  [K // group_size, N] any float dtype
    offsets [K // group_size, N] like scales, or None (symmetric: w = scales * (u - 8))
    block_m: activation rows per program (multiple of 8; None: M rounded up to 8, at most 64).
    block_n, block_k: fixed at 64 and 128; accepted for the Triton kernel's signature.
    split_k: splits of the K // 128 full tiles (a divisor; None: `pick_split`). A K % 128 == 64
      tail is one split more.
    interpret: False, or e.g. `plgpu.InterpretGPUParams(detect_races=True)` to run on CPU.
    returns [M, N] in x.dtype
    """
    _check(x, packed, scales, offsets, group_size, block_m, block_n, block_k, split_k)
    m, k = x.shape
    n = packed.shape[1]
    g = group_size
    bm = block_m or _block_m(m)
    mp = -(-m // bm) * bm
    split = split_k or pick_split(m, k, n, bm)
    tail = _tail(k)
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))                                      # [Mp, K]
    xs = xp.astype(jnp.float32).reshape(mp, k // g, g).sum(-1).T               # [K/g, Mp]
    symmetric = offsets is None
    swizzle = g
    w_tr = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    kernel = functools.partial(int4_matmul_mgpu_kernel, group_size=g, block_m=bm,
                               tiles_per_split=k // _TILE_K // split, splits=split, tail=tail,
                               symmetric=symmetric, dtype=x.dtype)
    # The compiled program names the custom call by its body (a partial is 'anonymous').
    kernel.__name__ = kernel.func.__name__
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((split + tail, n, mp), jnp.float32),
        grid=(n // _BLOCK_N, mp // bm, split + tail),
        grid_names=("n", "m", "s"),
        scratch_types=[plgpu.SMEM((_TILE_K, _BLOCK_N), x.dtype, transforms=w_tr),
                       plgpu.SMEM((_BLOCK_N, bm), jnp.float32)],
        interpret=interpret,
    )
    args = [xp, xs, packed, scales] + ([] if symmetric else [offsets])
    out = call(*args)                                                  # [S (+ 1), N, Mp]
    return out.sum(0)[:, :m].T.astype(x.dtype)
