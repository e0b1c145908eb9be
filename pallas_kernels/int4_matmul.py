"""W4A16 matmul (int4 weights, 16/32-bit activations): Pallas Triton kernel, reference, quantizer.

Weight format for one [K, N] matrix with group size g along K (g in {32, 64, 128}, g divides K):
  packed  [K // 2, N] uint8: 4-bit codes u in [0, 15], two per byte, packed *within each group*:
          in group G (rows G*g .. G*g + g - 1), byte row G*g/2 + i (0 <= i < g/2) holds row
          G*g + i in its low nibble and row G*g + g/2 + i in its high nibble. For g = 32 this is
          GGUF's Q4_0/Q4_1 block layout (qs[i] = q[i] | q[i + 16] << 4), stored [K, N]-major.
  scales  [K // g, N] any float dtype (stored f32; the engine's GPU program passes bf16,
          jaxserve/quantization/gpu_format.py)
  offsets [K // g, N] any float dtype (f32 in the engine), or None for the symmetric variant
  w[k, n] = scales[k // g, n] * u[k, n] + offsets[k // g, n]
  offsets None means offsets = -8 * scales, i.e. w = s * (u - 8) (GGUF Q4_0). An asymmetric
  s * (u - z) loads as offsets = -s * z; GGUF Q4_1's d * u + m loads as offsets = m.

Why per-group halves: interleaving nibbles into rows takes Triton a join and a transpose per
tile (no value slicing or general concatenation), which cost more than a second dot (PTX counts,
docs/perf_kernels.md). The kernel instead views x [M, K] as [M, K/g, 2, g/2] (a free reshape)
and multiplies low nibbles by the first half of each group's activations, high nibbles by the
second.

The kernel reads the bytes as uint32 words (4 columns each) and unpacks two codes per 32-bit
operation, as c = 2^p + u in the activation dtype (`_unpack_words`). Kernel math, per tile of T
packed rows inside group G (c_lo, c_hi exact; xs = sum(x_lo) + sum(x_hi)):
  acc += s_G * (x_lo @ c_lo + x_hi @ c_hi) + xs * (b_G - 2^p s_G)
Scales and offsets are applied in f32 after the dot, so bf16 activations lose nothing to a rounded
bf16 dequantized weight; the only bf16 rounding is the final cast of the output. Tiles, and so
acc, hold their columns in `word_order`; the store puts them back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_MIN_DOT = 16   # Triton dot needs every dimension >= 16
_NUM_SMS = 132  # H200; split-K aims for at least one program per SM
# From this many tile rows the kernel sums each row's activations per group with a dot
# against ones ([bm, T] x [T, 16], 1/8 of the main dot's tensor work) instead of converting
# and adding the [bm, 2T] tile (~2 instructions per packed byte at 64 rows). Below it the
# 16-wide row max of the dot's layout costs more than it saves (PTX counts,
# docs/perf_kernels.md "16-64 rows").
_ONES_DOT_ROWS = 64


# Per activation dtype: (bits of 2^p, 2^p) for a float with p mantissa bits, whose OR with a code
# u < 2^p is the float 2^p + u. The 16-bit dtypes take the bits twice, once per half-word.
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x43004300, 128.0),
          jnp.dtype(jnp.float16): (0x64006400, 1024.0),
          jnp.dtype(jnp.float32): (0x4B000000, 2.0 ** 23)}
_PAIR_MASK = 0x000F000F  # one nibble in each 16-bit half of a word


def _interleave(p, q):
    """Two (low half, high half) pairs of [T, W] arrays -> [T, 4W], position 4c + 2b + a
    taking pair b's half a: each word's two halves stay adjacent (no byte permutes), so the
    tile's columns come in `word order`."""
    t, w = p[0].shape
    both = jnp.stack([jnp.stack([p[0], q[0]], axis=-1), jnp.stack([p[1], q[1]], axis=-1)],
                     axis=-1)  # [T, W, 2 (b), 2 (a)]
    return both.reshape(t, 4 * w)


def word_order(v):
    """[R, N] -> [R, N] with columns 4c + 1 and 4c + 2 swapped: the order `_unpack_words`
    gives a word's columns 4c..4c+3 in (bytes 0 and 2 share a word, as do 1 and 3). Its own
    inverse."""
    r, n = v.shape
    return jnp.swapaxes(v.reshape(r, n // 4, 2, 2), 2, 3).reshape(r, n)


def _unpack_words(words, dtype):
    """uint32 words [T, W] (4 packed bytes each: columns 4c..4c+3, byte 0 least significant)
    -> (low, high) nibbles [T, 4W] in `dtype`, each plus `_bias(dtype)`.

    Shifting a word by 0/4/8/12 and masking one nibble per 16-bit half puts two codes (bytes 0
    and 2, or 1 and 3) in a word at once; for 16-bit floats OR-ing 2^p's bits into both halves
    makes each half the float 2^p + u, exact, with no integer-to-float conversion (a
    quarter-rate instruction) and no subtraction: the kernel removes 2^p once per output from
    the activation sums it already has. So a word's eight codes cost three shifts and four
    and/or pairs (one LOP3 each in SASS). f32 takes one code per word and subtracts 2^23.
    """
    dtype = jnp.dtype(dtype)
    u16, u32 = jnp.uint16, jnp.uint32
    if dtype.itemsize == 2 and dtype in _MAGIC:
        bits = u32(_MAGIC[dtype][0])

        def pair(shift):
            a = ((words >> shift) & u32(_PAIR_MASK)) | bits  # [T, W], two floats
            return (jax.lax.bitcast_convert_type(a.astype(u16), dtype),
                    jax.lax.bitcast_convert_type((a >> 16).astype(u16), dtype))
    else:
        def pair(shift):
            a = (words >> shift) & u32(_PAIR_MASK)
            halves = (a & u32(0xFFFF), a >> 16)
            if dtype not in _MAGIC:
                return tuple(h.astype(dtype) for h in halves)
            bits, bias = _MAGIC[dtype]
            return tuple(jax.lax.bitcast_convert_type(h | u32(bits), dtype) - dtype.type(bias)
                         for h in halves)
    return _interleave(pair(0), pair(8)), _interleave(pair(4), pair(12))


def _bias(dtype) -> float:
    """What `_unpack_words` leaves added to every code in `dtype` (2^p for 16-bit floats)."""
    dtype = jnp.dtype(dtype)
    return _MAGIC[dtype][1] if dtype.itemsize == 2 and dtype in _MAGIC else 0.0


def words_of(packed) -> jax.Array:
    """[..., N] uint8 -> [..., N/4] uint32 (a bitcast: byte j of a word is column 4c + j)."""
    *lead, n = packed.shape
    return jax.lax.bitcast_convert_type(packed.reshape(*lead, n // 4, 4), jnp.uint32)


def _int4_matmul_kernel(x_ref, packed_ref, scales_ref, *rest, group_size, block_k, symmetric):
    """One [bm, bn] output tile, summed over this program's K split.

    x_ref [bm, Gs, 2, g/2]; packed_ref [Gs, g/2, bn/4] uint32 (`words_of`); scales_ref and
    offsets_ref [Gs, bn];
    out_ref [bm, bn] (or [1, bm, bn] partial sums when split-K). Gs = groups in this split; a
    split inside a group sees a sub-group (g = the split's rows) with the group's scale.
    out_ref with one row ([1, bn] or [1, 1, bn]) takes the sum of the tile's rows: M = 1 padded to
    bm, whose padding rows are zeros, so only the real row is written.
    """
    offsets_ref, out_ref = (None, rest[0]) if symmetric else rest
    half = group_size // 2
    tile = min(group_size, block_k) // 2          # packed rows per dot
    groups_per_step = max(1, block_k // group_size)
    tiles_per_group = half // tile
    num_groups = packed_ref.shape[0]
    num_steps = num_groups * tiles_per_group // groups_per_step
    dtype = x_ref.dtype
    f32 = jnp.float32
    bias = _bias(dtype)

    def tile_update(acc, grp, off):
        x_lo = x_ref[:, grp, 0, pl.ds(off, tile)]                   # [bm, T]
        x_hi = x_ref[:, grp, 1, pl.ds(off, tile)]                   # [bm, T]
        u_lo, u_hi = _unpack_words(packed_ref[grp, pl.ds(off, tile), :], dtype)  # [T, bn]
        dot = functools.partial(jnp.dot, preferred_element_type=f32,
                                precision=jax.lax.Precision.HIGHEST)
        d = dot(x_lo, u_lo) + dot(x_hi, u_hi)                       # [bm, bn]
        if x_lo.shape[0] >= _ONES_DOT_ROWS:  # row sums on the tensor cores: 16 equal columns
            ones = jnp.ones((tile, _MIN_DOT), dtype)                # [T, 16]
            xs = jnp.max(dot(x_lo, ones) + dot(x_hi, ones), axis=1, keepdims=True)
        else:
            xs = jnp.sum(x_lo.astype(f32) + x_hi.astype(f32), axis=1, keepdims=True)  # [bm, 1]
        # The tile's columns (so d's and acc's) are in word order: so are the scales'.
        s = word_order(scales_ref[pl.ds(grp, 1), :].astype(f32))    # [1, bn]
        # Codes come biased by 2^p (exact in the dot: x times integers < 2^(p+1) is exact in
        # f32); the bias (and the symmetric -8) join the offsets on the [1, bn] row, so each
        # output element costs two multiply-adds per group.
        if symmetric:
            b = -(bias + 8.0) * s
        else:
            b = word_order(offsets_ref[pl.ds(grp, 1), :].astype(f32)) - bias * s  # [1, bn]
        return acc + s * d + xs * b

    def step(i, acc):
        if tiles_per_group > 1:  # block_k < g: several steps per group
            return tile_update(acc, i // tiles_per_group, (i % tiles_per_group) * tile)
        for j in range(groups_per_step):  # block_k >= g: whole groups, unrolled
            acc = tile_update(acc, i * groups_per_step + j, 0)
        return acc

    bm, bn = x_ref.shape[0], out_ref.shape[-1]
    acc = jax.lax.fori_loop(0, num_steps, step, jnp.zeros((bm, bn), f32))
    if out_ref.shape[-2] == 1 and bm > 1:
        acc = jnp.sum(acc, axis=0, keepdims=True)  # [1, bn]
    acc = word_order(acc)  # back to column order
    out_ref[...] = acc.reshape(out_ref.shape).astype(out_ref.dtype)


def _int4_matmul_call(x4, packed3, scales, offsets, *, block_m, block_n, block_k, split_k,
                      out_rows, out_dtype, compiler_params, interpret):
    """x4 [Mp, K/g, 2, g/2]; packed3 [K/g, g/2, N/4] uint32 words; scales, offsets [K/g, N].

    split_k <= K/g splits whole groups (it divides K/g); split_k = K/g * d cuts each group into
    d sub-groups, program s taking part s % d of group s // d. out_rows is Mp, or 1 when M = 1.
    Returns [out_rows, N] in out_dtype, or f32 partial sums [split_k, out_rows, N] when
    split_k > 1.
    """
    mp, num_groups, _, half = x4.shape
    n = 4 * packed3.shape[-1]
    if split_k <= num_groups:  # whole groups per split
        gs, sub, rows = num_groups // split_k, 1, half
        grp = lambda s: s  # noqa: E731 - block index along the group axis
        part = lambda s: 0  # noqa: E731 - block index along the half-group axis
    else:
        gs, sub = 1, split_k // num_groups
        rows = half // sub
        grp = lambda s: s // sub  # noqa: E731
        part = lambda s: s % sub  # noqa: E731
    symmetric = offsets is None
    in_specs = [
        pl.BlockSpec((block_m, gs, 2, rows), lambda i, j, s: (i, grp(s), 0, part(s))),
        pl.BlockSpec((gs, rows, block_n // 4), lambda i, j, s: (grp(s), part(s), j)),
        pl.BlockSpec((gs, block_n), lambda i, j, s: (grp(s), j)),
    ]
    args = [x4, packed3, scales]
    if not symmetric:
        in_specs.append(pl.BlockSpec((gs, block_n), lambda i, j, s: (grp(s), j)))
        args.append(offsets)
    bo = min(block_m, out_rows)
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((out_rows, n), out_dtype)
        out_spec = pl.BlockSpec((bo, block_n), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, out_rows, n), jnp.float32)
        out_spec = pl.BlockSpec((1, bo, block_n), lambda i, j, s: (s, i, j))
    kernel = functools.partial(_int4_matmul_kernel, group_size=2 * rows, block_k=block_k,
                               symmetric=symmetric)
    return pl.pallas_call(
        kernel,
        grid=(mp // block_m, n // block_n, split_k),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="int4_matmul",
    )(*args)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def valid_splits(k: int, group_size: int) -> list[int]:
    """K splits the kernel takes, ascending: divisors of the group count (whole groups), then the
    group count times d for d dividing g / 32 (each group cut into d parts of >= 32 rows)."""
    num_groups = k // group_size
    whole = [s for s in range(1, num_groups + 1) if num_groups % s == 0]
    subs = [num_groups * d for d in range(2, group_size // (2 * _MIN_DOT) + 1)
            if (group_size // (2 * _MIN_DOT)) % d == 0]
    return whole + subs


def _modelled_cost(m: int, k: int, n: int, block_m: int, block_n: int, split_k: int,
                   group_size: int) -> float:
    """Relative time of one launch in a bandwidth model: bytes moved over the share of SMs busy.

    Weights, scales and offsets are read once; split-K partials are written and read back once
    (one row when M = 1, else the padded M) and weighted by a quarter, since at these sizes they
    stay in the 50 MB L2. Fewer programs than SMs leave SMs idle.
    """
    mp = -(-m // block_m) * block_m
    programs = (mp // block_m) * (n // block_n) * split_k
    weights = k * n // 2 + 6 * (k // group_size) * n  # GPU format: bf16 scales, f32 offsets
    partials = 0 if split_k == 1 else 2 * split_k * (1 if m == 1 else mp) * n * 4
    return (weights + partials / 4) / min(1.0, programs / _NUM_SMS)


def pick_blocks(m: int, k: int, n: int, group_size: int, *, block_m: int | None = None,
                block_n: int | None = None,
                block_k: int | None = None) -> tuple[int, int, int, int]:
    """Default (block_m, block_n, block_k, split_k) for an [m, k] x [k, n] int4 matmul.

    block_m: power of 2 in [16, 64] covering m (decode m = 1..16 -> 16). block_n: largest power of
    2 <= 128 dividing n (576 -> 64). split_k: the `valid_splits` entry with the least
    `_modelled_cost` (the smaller on ties), so small decode GEMMs split K down to 32-row pieces
    to occupy the SMs while large ones (or prefill-sized M) skip the partial sums. block_k:
    largest power of 2 <= 128 dividing k / split_k. A bandwidth model, unmeasured on a GPU.
    Blocks given as arguments are kept, and split_k chosen among those they allow.
    """
    block_m = block_m or min(64, max(_MIN_DOT, 1 << (max(m, 1) - 1).bit_length()))
    block_n = block_n or _largest_pow2_divisor(n, 128)
    splits = [s for s in valid_splits(k, group_size) if not block_k or (k // s) % block_k == 0]
    split_k = min(splits or [1],
                  key=lambda s: (_modelled_cost(m, k, n, block_m, block_n, s, group_size), s))
    block_k = block_k or _largest_pow2_divisor(k // split_k, 128)
    return block_m, block_n, block_k, split_k


def num_programs(m: int, k: int, n: int, group_size: int) -> int:
    """Programs one launch of `pick_blocks`' choice runs (for docs and checks)."""
    bm, bn, _, sk = pick_blocks(m, k, n, group_size)
    return -(-m // bm) * (n // bn) * sk


def _check(x, packed, scales, offsets, group_size, block_m, block_n, block_k, split_k):
    m, k = x.shape
    n = packed.shape[1]
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(group_size) and group_size >= 2 * _MIN_DOT and k % group_size == 0):
        raise ValueError(f"group_size {group_size} must be a power of 2 >= 32 dividing K={k}")
    if packed.shape != (k // 2, n) or packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8 [{k // 2}, N], got {packed.dtype} {packed.shape}")
    for name, a in (("scales", scales), ("offsets", offsets)):
        if a is not None and a.shape != (k // group_size, n):
            raise ValueError(f"{name} must be [{k // group_size}, {n}], got {a.shape}")
    if not (pow2(block_m) and block_m >= _MIN_DOT):
        raise ValueError(f"block_m {block_m} must be a power of 2 >= {_MIN_DOT}")
    if not (pow2(block_n) and block_n >= _MIN_DOT and n % block_n == 0):
        raise ValueError(f"block_n {block_n} must be a power of 2 >= {_MIN_DOT} dividing N={n}")
    if split_k not in valid_splits(k, group_size):
        raise ValueError(f"split_k {split_k} must divide the group count {k // group_size} or be "
                         f"one of {valid_splits(k, group_size)}")
    if not (pow2(block_k) and block_k >= 2 * _MIN_DOT and (k // split_k) % block_k == 0):
        raise ValueError(f"block_k {block_k} must be a power of 2 >= 32 dividing K/split_k="
                         f"{k // split_k}")


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "block_k",
                                             "split_k", "num_warps", "num_stages", "interpret"))
def int4_matmul(x, packed, scales, offsets, *, group_size: int, block_m=None, block_n=None,
                block_k=None, split_k=None, num_warps=None, num_stages=None,
                interpret=False) -> jax.Array:
    """x @ dequantize(packed, scales, offsets) with f32 accumulation; see the module docstring.

    x       [M, K] bf16 or f32 activations
    packed  [K // 2, N] uint8, two codes per byte, per-group halves layout
    scales  [K // group_size, N] f32 or x.dtype
    offsets [K // group_size, N] like scales, or None (symmetric: w = scales * (u - 8))
    block_*, split_k: None picks `pick_blocks` defaults; M is padded to a multiple of block_m.
      split_k is one of `valid_splits(K, group_size)`.
    num_warps, num_stages: Triton launch parameters (None: Triton's defaults); ignored when
      interpreting.
    returns [M, N] in x.dtype
    """
    m, k = x.shape
    n = packed.shape[1]
    d_bm, d_bn, d_bk, d_sk = pick_blocks(m, k, n, group_size, block_m=block_m,
                                         block_n=block_n, block_k=block_k)
    block_m, block_n = d_bm, d_bn
    split_k = split_k or d_sk
    block_k = block_k or _largest_pow2_divisor(k // split_k, 128)
    _check(x, packed, scales, offsets, group_size, block_m, block_n, block_k, split_k)
    mp = -(-m // block_m) * block_m
    g = group_size
    x4 = jnp.pad(x, ((0, mp - m), (0, 0))).reshape(mp, k // g, 2, g // 2)  # [Mp, K/g, 2, g/2]
    packed3 = words_of(packed.reshape(k // g, g // 2, n))  # [K/g, g/2, N/4] uint32
    # Interpreters ignore Triton params, and the strict (TPU) interpreter rejects them.
    params = None
    if not interpret and (num_warps or num_stages):
        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = _int4_matmul_call(x4, packed3, scales, offsets, block_m=block_m, block_n=block_n,
                            block_k=block_k, split_k=split_k, out_rows=1 if m == 1 else mp,
                            out_dtype=x.dtype, compiler_params=params, interpret=interpret)
    if split_k > 1:
        out = out.sum(axis=0)
    return out[:m].astype(x.dtype)


def int4_matmul_reference(x, packed, scales, offsets, *, group_size) -> jax.Array:
    """Dequantizes in f32, then an f32 matmul; returns [M, N] in x.dtype."""
    w = dequantize_int4(packed, scales, offsets, group_size=group_size)
    out = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def pack_int4(u, *, group_size: int) -> jax.Array:
    """Codes u [K, N] (ints in [0, 15]) -> [K // 2, N] uint8 in the per-group halves layout."""
    k, n = u.shape
    u = u.astype(jnp.uint8).reshape(k // group_size, 2, group_size // 2, n)
    return (u[:, 0] | (u[:, 1] << 4)).reshape(k // 2, n)


def unpack_int4(packed, *, group_size: int) -> jax.Array:
    """[K // 2, N] uint8 -> codes u [K, N] int32 in [0, 15] (inverse of `pack_int4`)."""
    k2, n = packed.shape
    q = packed.astype(jnp.int32).reshape(2 * k2 // group_size, 1, group_size // 2, n)
    return jnp.concatenate([q & 0xF, q >> 4], axis=1).reshape(2 * k2, n)


def dequantize_int4(packed, scales, offsets, *, group_size: int) -> jax.Array:
    """-> w [K, N] f32 = scales * u + offsets per group (offsets None: scales * (u - 8))."""
    u = unpack_int4(packed, group_size=group_size).astype(jnp.float32)
    k, n = u.shape
    s = scales.astype(jnp.float32)[:, None, :]
    b = -8.0 * s if offsets is None else offsets.astype(jnp.float32)[:, None, :]
    return (s * u.reshape(k // group_size, group_size, n) + b).reshape(k, n)


@functools.partial(jax.jit, static_argnames=("group_size", "symmetric"))
def quantize_int4(w, *, group_size: int = 128, symmetric: bool = False):
    """Round-to-nearest int4 of w [K, N], per group of `group_size` rows along K.

    Returns (packed [K/2, N] uint8, scales [K/g, N] f32, offsets [K/g, N] f32 or None).

    Asymmetric: s = (max - min) / 15, u = clip(round((w - min) / s), 0, 15), offsets = min, so
      w ~ s * u + min with |error| <= s / 2 (both ends of the range are exact codes).
    Symmetric: s = max|w| / 7, u = round(w / s) + 8 in [1, 15], offsets None (w ~ s * (u - 8));
      zero maps to u = 8 exactly, |error| <= s / 2; code 0 (-8) is unused.
    A constant group (s = 0) gets s = 1 so that it dequantizes exactly. scales/offsets are f32.
    """
    k, n = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"group_size {group_size} must be even and divide K={k}")
    wg = w.astype(jnp.float32).reshape(k // group_size, group_size, n)
    if symmetric:
        s = jnp.max(jnp.abs(wg), axis=1) / 7.0
        s = jnp.where(s == 0, 1.0, s)
        u = jnp.clip(jnp.round(wg / s[:, None]) + 8, 0, 15)
        offsets = None
    else:
        lo, hi = jnp.min(wg, axis=1), jnp.max(wg, axis=1)
        s = (hi - lo) / 15.0
        s = jnp.where(s == 0, 1.0, s)
        u = jnp.clip(jnp.round((wg - lo[:, None]) / s[:, None]), 0, 15)
        offsets = lo
    return pack_int4(u.reshape(k, n), group_size=group_size), s, offsets
