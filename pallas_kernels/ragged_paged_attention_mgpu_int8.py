"""The int8-cache half of the Mosaic GPU ragged paged attention
(ragged_paged_attention_mgpu.py, whose docstring gives the design): the producer warpgroup
that stages a page's codes and scales and hands the compute warpgroups bf16 codes and one KV
head's scale vectors, its shared memory and its scratch."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

MAX_COPY = 256  # elements a TMA copy moves along a dimension


def slab_width(block_size: int, num_kv_heads: int) -> int:
    """f32 scales read per page: its `[BS, K]` slab, rounded up to the 128 bytes a
    Lane-semantics copy moves in whole."""
    return -(-block_size * num_kv_heads // 32) * 32


def smem_bytes(keys: int, head_dim: int, block_size: int, num_kv_heads: int, stages: int,
               slots: int) -> int:
    """Shared memory beside the bf16 kernel's: `stages` buffers of K and V codes (int8) and
    of the step's pages' scale slabs, and each slot's two scale vectors."""
    slabs = keys // block_size
    return (stages * 2 * (keys * head_dim + 4 * slabs * slab_width(block_size, num_kv_heads))
            + slots * 2 * keys * 4)


def scratch(stages: int, slots: int, pages_per_step: int, block_size: int, num_kv_heads: int,
            head_dim: int) -> list:
    """plgpu.kernel scratch: codes, slabs, scale vectors, the staging and ready barriers."""
    keys = pages_per_step * block_size
    width = slab_width(block_size, num_kv_heads)
    copies = 2 * pages_per_step * (1 + -(-width // MAX_COPY))  # per stage: codes and slabs
    return [plgpu.SMEM((stages, 2, keys, head_dim), jnp.int8,
                       transforms=(plgpu.TilingTransform((8, head_dim)),
                                   plgpu.SwizzleTransform(head_dim))),
            plgpu.SMEM((stages, 2, pages_per_step, width), jnp.float32),
            plgpu.SMEM((slots, 2, keys), jnp.float32),
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
            plgpu.Barrier(num_barriers=slots)]


def flat_scales(scales):
    """`[L, NB, BS, K]` f32 flattened (a bitcast): each page's slab is one contiguous run.
    Padded to one slab's read only where the whole array is shorter (tiny test caches)."""
    width = slab_width(scales.shape[2], scales.shape[3])
    return jnp.pad(scales.reshape(-1), (0, max(0, width - scales.size)))


def producer(pt_ref, k_ref, v_ref, ks_ref, vs_ref, pt_smem, pt_bar, k_smem, v_smem, k_free,
             v_free, k_ready, v_ready, codes_smem, slab_smem, scale_smem, staged, *, kv_head,
             layer, row, first_page, num_pages, steps, step_key0, kv_start, kv_end,
             block_size, pages_per_step, stages):
    """The producer of an int8 cache: TMAs the step's codes `[BS, Dh]` and its pages' whole
    scale slabs `[BS, K]` (contiguous: the scales of one head are strided by K, which no TMA
    box can read) into staging buffer `step % stages`, then, once the compute warpgroups
    have freed slot `step % slots`, writes the codes there as bf16 (exact: |code| <= 128)
    and gathers this KV head's scales into two `[keys]` vectors (scalar reads of the slab;
    the value scales zeroed outside the tile's keys, where they may be NaN and the finite
    codes times p = 0 would not cancel them). The compute warpgroups apply the scales to the
    logits' and probabilities' columns in f32, as the Triton kernel does."""
    plgpu.copy_gmem_to_smem(pt_ref.at[row], pt_smem, pt_bar)
    plgpu.barrier_wait(pt_bar)
    last_page = first_page + num_pages - 1
    keys = pages_per_step * block_size
    num_kv_heads, num_blocks = k_ref.shape[3], k_ref.shape[1]
    slab, slab_w = block_size * num_kv_heads, slab_smem.shape[-1]
    slots, meta_w = k_smem.shape[0], pt_smem.shape[-1]  # the ring's depth; table row width

    def issue(step, stage):
        for j in range(pages_per_step):
            p = jnp.minimum(first_page + step * pages_per_step + j, last_page)
            block = pt_smem[p // meta_w, p % meta_w]
            # A copy moves a multiple of 128 bytes (Lane semantics): slab_w >= BS * K scales
            # from the slab's start; past the array's end TMA fills zeros.
            start = (layer * num_blocks + block) * slab
            dst = pl.ds(j * block_size, block_size)
            for kv, (codes, scales) in enumerate(((k_ref, ks_ref), (v_ref, vs_ref))):
                plgpu.copy_gmem_to_smem(codes.at[layer, block, :, kv_head],
                                        codes_smem.at[stage, kv, dst], staged.at[stage])
                for c in range(0, slab_w, MAX_COPY):  # a copy moves <= 256 per dimension
                    run = pl.ds(c, min(MAX_COPY, slab_w - c))
                    plgpu.copy_gmem_to_smem(scales.at[pl.ds(start + c, run.size)],
                                            slab_smem.at[stage, kv, j, run], staged.at[stage])

    for i in range(stages):
        pl.when(i < steps)(functools.partial(issue, i, i))
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    key = plgpu.broadcasted_iota(jnp.int32, (keys,), 0, layout=row_layout)

    @pl.loop(0, steps)
    def _(step):
        slot, stage = lax.rem(step, slots), lax.rem(step, stages)
        plgpu.barrier_wait(staged.at[stage])

        @pl.when(step >= slots)
        def _():
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
        for kv, dst in enumerate((k_smem, v_smem)):
            codes = plgpu.load(codes_smem.at[stage, kv], layout=plgpu.Layout.WGMMA)
            dst.at[slot][...] = codes.astype(dst.dtype)
            scale = plgpu.layout_cast(jnp.zeros((keys,), jnp.float32), row_layout)
            for j in range(pages_per_step):  # [keys]: this head's column of the slabs
                for r in range(block_size):
                    s_r = slab_smem[stage, kv, j, r * num_kv_heads + kv_head]
                    scale = jnp.where(key == j * block_size + r, s_r, scale)
            if kv:
                k_pos = step_key0(step) + key
                scale = jnp.where((k_pos >= kv_start) & (k_pos < kv_end), scale, 0.0)
            scale_smem.at[slot, kv][...] = scale
        plgpu.commit_smem()  # the stores to wgmma's proxy; the reads before the refill
        plgpu.barrier_arrive(k_ready.at[slot])
        plgpu.barrier_arrive(v_ready.at[slot])

        @pl.when(step + stages < steps)
        def _():
            issue(step + stages, stage)
