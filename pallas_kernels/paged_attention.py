"""Paged-attention decode kernel (Pallas, Triton GPU backend) and its jax.numpy reference.

The engine's step runs the ragged kernel (ragged_paged_attention.py); this decode-only kernel
stays as the baseline the GPU check times the ragged one against on decode steps, and as the
home of the int8 cache helpers both kernels share (check_scales, dequantize_cache).

One query token per sequence attends over that sequence's pages of the engine's KV cache
`[L, NB, BS, K, Dh]` (all layers; block-major; block 0 is the null block). The kernel reads pages
straight from the full cache in global memory with indices computed from `layer`, the page table
and the token position, so no per-layer slice of the cache is ever materialised.

Grid (batch, kv_head, split): a program takes the G query heads that share one KV head (padded
to Gp = max(16, next power of 2) rows: Triton's tensor-core dot wants M >= 16) and a contiguous
range of pages, visiting only pages that hold context. Each page is one [BS, Dh] tile loaded with
`pl.ds` at (layer, block, :, kv_head, :), several pages per loop step; an online softmax in
float32 (one update per step) gives a partial (out, max, sum) per split, and a jnp combine merges
the splits, so a few long sequences still fill the GPU (docs/perf_kernels.md).

GPU (Triton) support: head_dim 64 or 128 (any power of 2 lowers), block sizes 8..256 (powers of
2; 8 compiles to a dot with a K/N of 8, which Triton accepts but is unverified on a GPU here), bf16
and f32 (f32 dots at IEEE precision, not TF32). Other block sizes (1, 2, 4, non-powers of 2) are
the XLA path's job (jaxserve/runtime/attention.py).

int8 cache (k_scale/v_scale given): as ragged_paged_attention.py, codes read in q's dtype and
the float32 scales applied to the logits and to the probabilities of the PV dot.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import (MASK_VALUE, MIN_DOT_ROWS, NO_WINDOW, default_pages_per_split,
                                      default_pages_per_step, dot, next_pow2, softmax_update)


def check_scales(q, k_cache, v_cache, k_scale, v_scale) -> tuple:
    """(k_scale, v_scale) of an int8 cache, () for a float one; raises on a mismatch."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (an int8 cache) or neither")
    if k_scale is None:
        if k_cache.dtype == jnp.int8:
            raise ValueError("an int8 KV cache needs its k_scale and v_scale")
        return ()
    if k_cache.dtype != jnp.int8 or v_cache.dtype != jnp.int8:
        raise ValueError(f"scales come with an int8 cache, got {k_cache.dtype}/{v_cache.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"with an int8 cache q is float32 or bfloat16, got {q.dtype}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.shape != k_cache.shape[:-1] or x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 {k_cache.shape[:-1]} (the cache's shape "
                             f"less head_dim), got {x.dtype} {x.shape}")
    return (k_scale, v_scale)


def dequantize_cache(codes, scale):
    """An int8 cache's values `[..., Dh]` float32: codes * scale `[...]`."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def _paged_attention_kernel(layer_ref, window_ref, lens_ref, pt_ref, q_ref, k_ref, v_ref,
                            *refs,  # [k_scale_ref, v_scale_ref,] o_ref[, m_ref, l_ref]
                            pages_per_split: int, pages_per_step: int, sm_scale: float,
                            softcap: float | None, quantized: bool):
    # layer_ref [1], window_ref [1], lens_ref [B], pt_ref [B, P]: whole arrays (scalars).
    # q_ref [Gp, Dh]; k_ref/v_ref [L, NB, BS, K, Dh] whole caches; int8: k/v_scale_ref
    # [L, NB, BS, K] whole. Outputs (one split's partial result): o_ref [Gp, Dh]; m_ref, l_ref
    # [Gp], absent when there is one split (o_ref then holds the output in q's dtype).
    scale_refs, (o_ref, *ml_refs) = (refs[:2], refs[2:]) if quantized else ((), refs)
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = k_ref.shape[2], k_ref.shape[4]
    layer = layer_ref[0]
    length = lens_ref[b]
    first_page = s * pages_per_split
    # Only pages holding at least one valid token are visited: table entries past the context
    # (which may be garbage block ids) are never read, nor the blocks they name. The table's
    # width also bounds it, so even a context_len beyond P * BS reads nothing out of bounds.
    n_pages = jnp.minimum(pl.cdiv(length, block_size), pt_ref.shape[1]) - first_page
    n_pages = jnp.minimum(jnp.maximum(n_pages, 0), pages_per_split)
    # Sliding window: the query (at length - 1) sees keys from lo on; earlier pages are skipped.
    lo = jnp.maximum(length - window_ref[0], 0)
    first_step = jnp.clip(lo // block_size - first_page, 0, n_pages) // pages_per_step

    q = q_ref[...]  # [Gp, Dh]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    slot = lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)

    def page_logits(local):
        """Masked logits `[Gp, BS]` f32 and values `[BS, Dh]` of this split's page `local`.
        Pages past the split's visible ones (the next split's) read the null block, masked."""
        in_split = local < n_pages
        page = first_page + local
        block = jnp.where(in_split, pt_ref[b, jnp.minimum(page, pt_ref.shape[1] - 1)], 0)
        k = k_ref[layer, block, pl.ds(0, block_size), h, pl.ds(0, head_dim)]  # [BS, Dh]
        v = v_ref[layer, block, pl.ds(0, block_size), h, pl.ds(0, head_dim)]
        key_pos = page * block_size + slot  # [BS, 1]
        valid = (key_pos < length) & (key_pos >= lo) & in_split  # [BS, 1]
        if quantized:  # codes convert exactly (|code| <= 127)
            k = k.astype(q.dtype)
        logits = dot(q, k, 1, precision) * sm_scale  # [Gp, BS] f32
        vs = None
        if quantized:  # the scales of unseen slots may be NaN: masked below, zeroed for PV
            at = (layer, block, pl.ds(0, block_size), h)
            logits = logits * scale_refs[0][at].reshape(1, block_size)
            vs = jnp.where(valid.reshape(1, block_size),
                           scale_refs[1][at].reshape(1, block_size), 0.0)  # [1, BS]
            v = v.astype(q.dtype)
        else:
            # Slots past the context (last page only) hold anything, NaN included: p = 0 alone
            # would not cancel 0 * NaN in p @ v, so zero them.
            v = jnp.where(valid, v, jnp.zeros_like(v))
        if softcap is not None:  # before the mask, as transformers' Gemma 2
            logits = softcap * jnp.tanh(logits / softcap)
        return jnp.where(valid.reshape(1, block_size), logits, MASK_VALUE), v, vs

    def body(i, carry):
        # carry: acc [Gp, Dh], max [Gp], sum [Gp] float32. All of a step's pages are loaded before the softmax update (several loads in flight).
        pages = [page_logits(i * pages_per_step + j) for j in range(pages_per_step)]
        return softmax_update(carry, pages, precision)  # acc [Gp, Dh]

    gp = q.shape[0]
    init = (jnp.zeros((gp, head_dim), jnp.float32),
            jnp.full((gp,), MASK_VALUE, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    acc, m, l = lax.fori_loop(first_step, pl.cdiv(n_pages, pages_per_step), body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    if ml_refs:
        ml_refs[0][...] = m
        ml_refs[1][...] = l


def _paged_attention_call(layer, window, context_lens, page_table, q, k_cache, v_cache, scales,
                          *, pages_per_split: int, num_splits: int, pages_per_step: int,
                          sm_scale: float, softcap: float | None, num_warps: int,
                          num_stages: int, interpret):
    """Partial results per split: out `[S, B, K, Gp, Dh]` f32, max and sum `[S, B, K, Gp]` f32;
    with one split only the out, `[1, B, K, Gp, Dh]` in q's dtype (max and sum None)."""
    batch, num_kv_heads, gp, head_dim = q.shape
    kernel = functools.partial(_paged_attention_kernel, pages_per_split=pages_per_split,
                               pages_per_step=pages_per_step, sm_scale=sm_scale,
                               softcap=softcap, quantized=bool(scales))
    # Whole arrays: on Triton a ref is a pointer into global memory, nothing is copied; the
    # kernel computes its own indices. (memory_space=pl.ANY lowers the same on
    # Triton but the strict interpreter refuses direct loads from it.)
    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    part = (num_splits, batch, num_kv_heads, gp)
    row = pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0))
    out_specs = [pl.BlockSpec((None, None, None, gp, head_dim), lambda b, h, s: (s, b, h, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct(part + (head_dim,),
                                      q.dtype if num_splits == 1 else jnp.float32)]
    if num_splits > 1:  # the combine needs each split's max and sum
        out_specs += [row, row]
        out_shape += [jax.ShapeDtypeStruct(part, jnp.float32)] * 2
    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[whole(layer), whole(window), whole(context_lens), whole(page_table),
                  pl.BlockSpec((None, None, gp, head_dim), lambda b, h, s: (b, h, 0, 0)),
                  whole(k_cache), whole(v_cache), *map(whole, scales)],
        out_specs=out_specs,
        out_shape=out_shape,
        # Interpreters ignore Triton params, and the strict (TPU) interpreter rejects them.
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                                    num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(layer, window, context_lens, page_table, q, k_cache, v_cache, *scales)
    return tuple(outs) if num_splits > 1 else (outs[0], None, None)


@functools.partial(jax.jit, static_argnames=("pages_per_split", "pages_per_step", "sm_scale",
                                             "softcap", "num_warps", "num_stages",
                                             "interpret"))
def paged_attention(q, k_cache, v_cache, layer, page_table, context_lens, *, k_scale=None,
                    v_scale=None, window=None, softcap: float | None = None,
                    pages_per_split: int | None = None, pages_per_step: int | None = None,
                    sm_scale: float | None = None, num_warps: int = 4, num_stages: int = 2,
                    interpret=False) -> jax.Array:
    """Decode attention of one query token per sequence over its pages of the KV cache.

    Args:
      q: `[B, H, Dh]` bf16 or f32, one query token per row; H = K * G.
      k_cache, v_cache: `[L, NB, BS, K, Dh]` the caches of all layers (block 0 = null block).
      k_scale, v_scale: int8 caches only: `[L, NB, BS, K]` float32, each (token, KV head)'s
        scale (the cache's values are codes * scale); None for float caches.
      layer: int32 scalar, may be traced (e.g. inside `lax.scan` over layers).
      page_table: `[B, P]` int32 block ids; token i of row b is at
        `(page_table[b, i // BS], i % BS)`. Entries past the context may hold anything.
      context_lens: `[B]` int32; keys at positions `< context_lens[b]` are attended to. A row
        with 0 gives zeros.
      window: int32 scalar or None, may be traced: the query (at position context_lens - 1)
        sees only the last `window` keys; None: all of them.
      softcap: static float or None: logits become `softcap * tanh(logits / softcap)`.
      pages_per_split: pages each program handles; None: no split when the batch alone gives an
        H200 132 programs, else enough splits for about 264, at most 16, each a whole number
        of steps.
      pages_per_step: pages loaded per loop step (one softmax update for all of them); None
        picks 128 keys per step in bf16 (at most the table's width), one page in f32.
      num_warps, num_stages: Triton launch parameters.
      sm_scale: logit scale, default `1 / sqrt(Dh)`.
      interpret: False on GPU; True (or an interpreter's params object) to run on CPU.
    Returns:
      `[B, H, Dh]` in q.dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape != v_cache.shape or \
            k_cache.shape[-1] != head_dim:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    scales = check_scales(q, k_cache, v_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    gp = max(MIN_DOT_ROWS, next_pow2(group))
    num_pages = page_table.shape[1]
    step = pages_per_step or min(default_pages_per_step(block_size, q.dtype, num_pages),
                                 pages_per_split or num_pages)
    if step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")
    pps = pages_per_split or default_pages_per_split(batch * num_kv_heads, num_pages, step)
    num_splits = pl.cdiv(num_pages, pps)
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))  # [B, K, Gp, Dh]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(1)
    o, m, l = _paged_attention_call(
        jnp.asarray(layer, jnp.int32).reshape(1), window, context_lens.astype(jnp.int32),
        page_table.astype(jnp.int32), qg, k_cache, v_cache, scales, pages_per_split=pps,
        num_splits=num_splits, pages_per_step=step, sm_scale=scale, softcap=softcap,
        num_warps=num_warps,
        num_stages=num_stages, interpret=interpret)
    if num_splits == 1:
        out = o[0]
    else:  # weight each split's normalised output by its share of the softmax mass
        w = l * jnp.exp(m - m.max(axis=0))  # [S, B, K, Gp]; empty splits have l = 0
        total = w.sum(axis=0)
        out = (o * w[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :group].reshape(batch, num_heads, head_dim).astype(q.dtype)


def paged_attention_reference(q, k_cache, v_cache, layer, page_table, context_lens, *,
                              k_scale=None, v_scale=None, window=None,
                              softcap: float | None = None,
                              sm_scale: float | None = None) -> jax.Array:
    """Gathers each row's pages, masks past `context_lens` (and before the window), soft-caps,
    softmax in float32. Same shapes. An int8 cache (k_scale, v_scale given) is dequantized to
    float32 first."""
    if check_scales(q, k_cache, v_cache, k_scale, v_scale):
        k_cache, v_cache = dequantize_cache(k_cache, k_scale), dequantize_cache(v_cache, v_scale)
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    keys = k_cache[layer][page_table].astype(jnp.float32)  # [B, P, BS, K, Dh]
    values = v_cache[layer][page_table].astype(jnp.float32)
    keys = keys.reshape(batch, -1, num_kv_heads, head_dim)  # [B, S, K, Dh]
    values = values.reshape(batch, -1, num_kv_heads, head_dim)
    key_pos = jnp.arange(keys.shape[1])[None, :]  # [1, S]
    visible = key_pos < context_lens[:, None]  # [B, S]
    if window is not None:
        visible = visible & (key_pos >= context_lens[:, None] - window)
    # Zero what is not visible, so NaN garbage there cannot leak through 0 * NaN.
    keys = jnp.where(visible[:, :, None, None], keys, 0.0)
    values = jnp.where(visible[:, :, None, None], values, 0.0)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, keys,
                        precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None, :], probs, 0.0)  # rows with no context -> zeros
    out = jnp.einsum("bkgs,bskd->bkgd", probs, values, precision=lax.Precision.HIGHEST)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
