"""The KV-cache write of one step (Pallas, Triton GPU backend): K and V (and an int8 cache's
scales) in one kernel, in place, and its jax.numpy reference. The engine uses it for int8 and
f32 caches; a bf16 cache is written by the attention kernel itself
(`ragged_paged_attention_write`).

`write_kv_cache_quantized` takes the step's float K and V for an int8 cache and quantizes
them in the kernel (jaxserve/runtime/kv_quant.py's rule: per (token, KV head), scale
max|x| * f32(1/127), codes round-half-even of x times the scale's reciprocal, clipped to
+-127), writing codes and scales in the same launch: XLA's path is a quantize fusion, the k/v
split and four scatters. Triton has no round: half-even is computed from floor, exactly for
the |x * inv| <= 127.5 that arise. On a GPU, Triton divides f32 approximately (div.full, 2 ulp)
where XLA's CPU path divides exactly, so a code at a rounding tie may differ by one from
XLA's (error still <= (1/2 + 2^-21) steps); interpreted, the codes equal kv_quant's bit for bit.

XLA writes K and V as two scatters (one launch each, four for an int8 cache). This kernel
writes all of them in one launch: the caches are aliased to its outputs, so nothing is copied,
and each program scatters whole rows of Dh values, one per (token, KV head), at the token's
flat slot. Caches are viewed as `[L * NB * BS * K, Dh]` rows (a free reshape of the engine's
`[L, NB, BS, K, Dh]`: a token's KV heads are contiguous).

Padding tokens carry slots in the null block 0 and write there, as the scatters do; two of
them may write one slot, in either order: the null block is never read unmasked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import load_rows, next_pow2, store_rows

QMAX = 127.0  # jaxserve/runtime/kv_quant.py's (pallas_kernels does not import jaxserve)

_ROWS = 64  # (token, KV head) rows per program


def _program_rows(layer_ref, slots_ref, block_t: int, kp: int, num_kv_heads: int,
                  layer_rows: int):
    """This program's (token, KV head) rows `[M]`: token, head, in range, and the cache row
    each is written to (the layer's flat slot times K plus the head)."""
    i = lax.broadcasted_iota(jnp.int32, (block_t * kp,), 0)
    token, head = pl.program_id(0) * block_t + i // kp, i % kp  # [M]
    ok = (token < slots_ref.shape[0]) & (head < num_kv_heads)
    slot = plgpu.load(slots_ref.at[jnp.where(ok, token, 0)], mask=ok, other=0)  # [M]
    return token, head, ok, (layer_ref[0] * layer_rows + slot) * num_kv_heads + head


def _write_kernel(layer_ref, slots_ref, *refs, block_t: int, kp: int, num_kv_heads: int,
                  layer_rows: int, heads_at: tuple[tuple[int, int], ...]):
    # layer_ref [1], slots_ref [T]; then the new arrays (k, v: [T * Hn, Dh], the cache's K
    # heads at heads_at[i] = (first head, Hn); int8 adds k_scale, v_scale: [T * K]), the same
    # number of aliased cache inputs (unread) and the caches as outputs ([L * NB * BS * K, Dh]
    # and, int8, [L * NB * BS * K]), whole arrays.
    num_new = len(heads_at)
    new, outs = refs[:num_new], refs[2 * num_new:]
    token, head, ok, dst = _program_rows(layer_ref, slots_ref, block_t, kp, num_kv_heads,
                                         layer_rows)
    for value_ref, cache_ref, (first, stride) in zip(new, outs, heads_at):
        src = token * stride + first + head
        if len(value_ref.shape) == 1:  # an int8 cache's scales
            value = plgpu.load(value_ref.at[jnp.where(ok, src, 0)], mask=ok, other=0)
        else:
            value = load_rows(value_ref, src, ok, value_ref.shape[1])
        store_rows(cache_ref, dst, ok, value)


def round_half_even(y):
    """jnp.round (half to even) from floor, for Triton, which lowers no round: exact for
    |y| < 2^22 (y - floor(y) is then exact)."""
    f = jnp.floor(y)
    d = y - f
    odd = f - 2.0 * jnp.floor(f * 0.5)  # 1.0 where f is odd
    return f + jnp.where(d > 0.5, 1.0, jnp.where(d < 0.5, 0.0, odd))


def _quantize_kernel(layer_ref, slots_ref, k_ref, v_ref, *refs, block_t: int, kp: int,
                     num_kv_heads: int, layer_rows: int, heads_at: tuple[tuple[int, int], ...]):
    # layer_ref [1], slots_ref [T], k_ref and v_ref the float K and V ([T * Hn, Dh], the
    # cache's heads at heads_at), four aliased cache inputs (unread), then the outputs: codes
    # [L * NB * BS * K, Dh] int8 for K and V, then their scales [L * NB * BS * K] f32.
    outs = refs[4:]
    token, head, ok, dst = _program_rows(layer_ref, slots_ref, block_t, kp, num_kv_heads,
                                         layer_rows)
    for n, (value_ref, (first, stride)) in enumerate(zip((k_ref, v_ref), heads_at)):
        src = token * stride + first + head
        x = load_rows(value_ref, src, ok, value_ref.shape[1]).astype(jnp.float32)  # [M, Dh]
        scale = jnp.max(jnp.abs(x), axis=1) * jnp.float32(1.0 / QMAX)  # [M]
        inv = 1.0 / jnp.where(scale > 0, scale, 1.0)  # [M]
        codes = jnp.clip(round_half_even(x * inv[:, None]), -QMAX, QMAX)  # [M, Dh]
        store_rows(outs[n], dst, ok, codes.astype(jnp.int8))
        store_rows(outs[2 + n], dst, ok, scale)


@functools.partial(jax.jit, static_argnames=("heads_at", "interpret"))
def write_kv_cache_quantized(caches, layer, slots, new, *, heads_at=None, interpret=False):
    """Quantizes each token's new K and V per KV head and writes codes and scales into an
    int8 cache at its slot, in place (module docstring).

    Args:
      caches: (k, v) int8 `[L, NB, BS, K, Dh]` and (k_scale, v_scale) f32 `[L, NB, BS, K]`;
        updated in place when the caller donates them.
      layer, slots: as `write_kv_cache`.
      new: (k, v) float `[T, K, Dh]`, or with heads_at `[T, Hn, Dh]` arrays whose heads
        [heads_at[i], heads_at[i] + K) are cache i's (a packed [q | k | v] array).
    Returns:
      The four caches, same shapes.
    """
    if len(caches) != 4 or len(new) != 2 or caches[0].dtype != jnp.int8 or \
            caches[2].dtype != jnp.float32:
        raise ValueError(f"a quantized write takes int8 (k, v) and f32 scale caches and float "
                         f"(k, v); got caches {[(c.shape, c.dtype.name) for c in caches]}, "
                         f"new {[(n.shape, n.dtype.name) for n in new]}")
    heads_at = heads_at or (0, 0)
    for n, at in zip(new, heads_at):
        if not jnp.issubdtype(n.dtype, jnp.floating) or n.ndim != 3 or \
                n.shape[0] != slots.shape[0] or n.shape[2] != caches[0].shape[4] or \
                not 0 <= at <= n.shape[1] - caches[0].shape[3]:
            raise ValueError(f"new values {n.shape} {n.dtype} from head {at} do not fit cache "
                             f"{caches[0].shape}")
    return _call(_quantize_kernel, caches, layer, slots, new, heads_at, interpret)


@functools.partial(jax.jit, static_argnames=("heads_at", "interpret"))
def write_kv_cache(caches, layer, slots, new, *, heads_at=None, interpret=False):
    """Writes each token's new values into the caches at its slot, in place.

    Args:
      caches: a tuple of caches of all layers: (k, v) `[L, NB, BS, K, Dh]`, and for an int8
        cache also (k_scale, v_scale) `[L, NB, BS, K]`; updated in place when the caller
        donates them (the engine's step does).
      layer: int32 scalar, may be traced.
      slots: `[T]` int32 flat slot (block * BS + offset) of each token within the layer.
      new: the tuple of new values matching `caches`: `[T, K, Dh]` (in each cache's dtype)
        and, int8, `[T, K]` scales.
      heads_at: static, None or one first head per cache: new[i] is then `[T, Hn, Dh]` and
        cache i takes its heads [heads_at[i], heads_at[i] + K) (e.g. the keys and values of a
        packed [q | k | v] array, so that one fusion makes all three).
      interpret: False on GPU; True to run on CPU.
    Returns:
      The caches, same shapes.
    """
    if len(caches) != len(new) or any(c.shape[1:3] != caches[0].shape[1:3] for c in caches):
        raise ValueError(f"caches {[c.shape for c in caches]} do not match new values "
                         f"{[n.shape for n in new]}")
    num_layers, num_blocks, block_size, num_kv_heads = caches[0].shape[:4]
    num_tokens = slots.shape[0]
    heads_at = heads_at or (0,) * len(new)
    for c, n, at in zip(caches, new, heads_at):
        heads = n.shape[1] if n.ndim > 1 else 0
        if n.shape[:1] + n.shape[2:] != (num_tokens,) + c.shape[4:] or n.dtype != c.dtype or \
                len(heads_at) != len(new) or not 0 <= at <= heads - num_kv_heads:
            raise ValueError(f"new values {n.shape} {n.dtype} from head {at} do not fit cache "
                             f"{c.shape} {c.dtype} for {num_tokens} tokens")
    return _call(_write_kernel, caches, layer, slots, new, heads_at, interpret)


def _call(kernel_fn, caches, layer, slots, new, heads_at, interpret):
    """One launch of `kernel_fn` over the step's tokens, the caches aliased to its outputs."""
    num_layers, num_blocks, block_size, num_kv_heads = caches[0].shape[:4]
    num_tokens = slots.shape[0]
    kp = next_pow2(num_kv_heads)
    block_t = max(1, _ROWS // kp)
    rows = num_layers * num_blocks * block_size * num_kv_heads
    flat_caches = [c.reshape(rows, *c.shape[4:]) for c in caches]
    flat_new = [n.reshape(-1, *n.shape[2:]) for n in new]

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))

    args = [jnp.asarray(layer, jnp.int32).reshape(1), slots.astype(jnp.int32), *flat_new,
            *flat_caches]
    kernel = functools.partial(kernel_fn, block_t=block_t, kp=kp, num_kv_heads=num_kv_heads,
                               layer_rows=num_blocks * block_size,
                               heads_at=tuple((at, n.shape[1]) for at, n in zip(heads_at, new)))
    first_cache = 2 + len(new)
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_t),),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(c) for c in flat_caches],
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in flat_caches],
        input_output_aliases={first_cache + i: i for i in range(len(caches))},
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kv_cache_write",
    )(*args)
    return tuple(o.reshape(c.shape) for o, c in zip(outs, caches))


def write_kv_cache_reference(caches, layer, slots, new):
    """The same write as XLA scatters, one per cache."""
    block_size = caches[0].shape[2]
    blk, off = slots // block_size, slots % block_size
    return tuple(c.at[layer, blk, off].set(n) for c, n in zip(caches, new))
