"""The kernel tests' inputs (pallas_kernels/cases.py) at GPU sizes, built once per run and shared
by the correctness and timing sections: paged-attention cases, mixed ragged steps, int4 weights.
Layers and weight copies are cycled so the timed reads exceed 2x L2 (they then come from HBM)."""

from __future__ import annotations

import math
import zlib

from jaxserve.tools.gpu_check.context import Ctx
from jaxserve.tools.gpu_check.profiles import ATTN_HEADS, L2_BYTES


def context_lengths(batch: int, max_ctx: int, block: int, seed: int) -> list[int]:
    """Mixed lengths up to max_ctx: one full, edge cases (1, a block, a block + 1), the rest
    uniform. A batch of one gets max_ctx - 3 (a long context ending inside a page)."""
    import numpy as np
    if batch == 1:
        return [max_ctx - 3]
    lens = np.random.default_rng(seed).integers(1, max_ctx + 1, size=batch)
    lens[0] = max_ctx
    for i, v in zip(range(1, batch), (1, block, block + 1)):
        lens[i] = v
    return [int(v) for v in lens]


def attention_case(ctx: Ctx, model: str, block: int, batch: int) -> dict:
    """The kernel tests' NaN-filled case (pallas_kernels/cases.py) at GPU size, bf16, with L
    layers, all live, chosen so the cycled layers exceed 2x L2 (timed reads then come from
    HBM)."""
    import numpy as np
    from pallas_kernels.cases import paged_case
    key = (model, block, batch)
    if key in ctx.cases:
        return ctx.cases[key]
    kh, g, dh = ATTN_HEADS[model]
    lens = context_lengths(batch, ctx.prof.max_context, block, seed=block * 1000 + batch)
    pages = [-(-n // block) for n in lens]
    per_layer = sum(pages) * block * kh * dh * 2 * 2  # K + V pages, bf16
    layers = int(min(ctx.prof.max_layers, max(2, math.ceil(2 * L2_BYTES / per_layer))))
    q, k, v, table, context_lens = paged_case(
        zlib.crc32(repr(key).encode()), dtype="bfloat16", block_size=block, num_kv_heads=kh,
        group=g, head_dim=dh, lens=lens, num_pages=max(pages), num_layers=layers)
    case = {"q": q, "k": k, "v": v, "page_table": table, "context_lens": context_lens,
            "layers": layers, "bytes_per_call": per_layer,
            "desc": {"model": model, "kv_heads": kh, "group": g, "head_dim": dh,
                     "block_size": block, "batch": batch, "max_len": max(lens),
                     "mean_len": float(np.mean(lens)), "pages": max(pages),
                     "cache_shape": list(k.shape)}}
    ctx.cases[key] = case
    return case


def ragged_rows(max_ctx: int, decode: int, block: int) -> list[tuple[int, int]]:
    """`decode` rows of 1 query (lengths as context_lengths), 4 speculative rows of 4, a later
    prefill chunk of max_ctx / 8 at context max_ctx / 2, a first chunk of max_ctx / 16 and a
    padding row: (q_len, context_len) each."""
    rows = [(1, n) for n in context_lengths(decode, max_ctx, block, seed=decode)]
    rows += [(4, max_ctx // 4 + i) for i in range(4)]
    return rows + [(max_ctx // 8, max_ctx // 2), (max_ctx // 16, max_ctx // 16), (0, 0)]


def ragged_step_case(ctx: Ctx, model: str, block: int, max_ctx: int, decode: int,
                     dtype: str = "bfloat16", cache_gib: float = 0.0) -> dict:
    """One mixed engine step (`ragged_rows`, a padded tail) on the kernel tests' NaN-filled
    ragged case; layers cycled to exceed 2x L2 as attention_case does. cache_gib > 0: two
    layers and spare blocks until each of K and V exceeds that many GiB (not cached in ctx)."""
    import jax.numpy as jnp
    from pallas_kernels.cases import ragged_case
    key = ("ragged", model, block, max_ctx, decode, dtype, cache_gib)
    if key in ctx.cases:
        return ctx.cases[key]
    kh, g, dh = ATTN_HEADS[model]
    rows = ragged_rows(max_ctx, decode, block)
    pages = [-(-c // block) for _, c in rows]
    block_bytes = block * kh * dh * jnp.dtype(dtype).itemsize  # one layer's K (or V) block
    per_layer = sum(pages) * block_bytes * 2  # K + V pages, each read once
    layers = int(min(ctx.prof.max_layers, max(2, math.ceil(2 * L2_BYTES / per_layer))))
    spare = 5
    if cache_gib:
        layers = 2
        spare = max(5, math.ceil(cache_gib * 2**30 / (layers * block_bytes)) - sum(pages))
    q, k, v, table, qs, lens = ragged_case(
        zlib.crc32(repr(key).encode()), dtype=dtype, block_size=block, num_kv_heads=kh,
        group=g, head_dim=dh, rows=rows, num_pages=max(pages), tail=5, num_layers=layers,
        num_spare=spare)
    case = {"args": (q, k, v, table, qs, lens), "layers": layers, "bytes_per_call": per_layer,
            "desc": {"model": model, "kv_heads": kh, "group": g, "head_dim": dh,
                     "block_size": block, "rows": len(rows), "tokens": int(q.shape[0]),
                     "max_len": max_ctx, "pages": max(pages), "cache_shape": list(k.shape),
                     "dtype": dtype, "cache_bytes": int(k.nbytes)}}
    if not cache_gib:
        ctx.cases[key] = case
    return case


def int4_weights(ctx: Ctx, k: int, n: int) -> dict:
    """The kernel tests' random codes with per-group scales and offsets (asymmetric, the
    engine's RTN format, bf16 scales and f32 offsets as the engine stores them for the GPU), in as many copies as make > 2x L2, plus bf16 dense copies for the
    dense baseline. Shared by every M of a (K, N)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.cases import int4_group_size
    from pallas_kernels.cases import int4_weights as case_weights
    key = ("int4", k, n)
    if key in ctx.cases:
        return ctx.cases[key]
    g = int4_group_size(k)
    # The engine's GPU format (quantization/gpu_format.py): bf16 scales, f32 offsets.
    wbytes = k * n // 2 + (k // g) * n * (2 + 4)
    copies = int(min(ctx.prof.max_copies, max(1, math.ceil(2 * L2_BYTES / wbytes))))
    dense_copies = int(min(ctx.prof.max_copies, max(1, math.ceil(2 * L2_BYTES / (2 * k * n)))))
    weights = [case_weights(k, n, g, symmetric=False, seed=i, scale_dtype=jnp.bfloat16,
                            offset_dtype=jnp.float32) for i in range(copies)]
    keys = jax.random.split(jax.random.key(k * 7 + n), dense_copies)
    dense = [jax.random.normal(keys[i], (k, n), jnp.bfloat16) * 0.02
             for i in range(dense_copies)]
    ctx.cases[key] = {"weights": weights, "dense": dense, "group_size": g,
                      "bytes_per_call": wbytes, "copies": copies}
    return ctx.cases[key]


def int4_case(ctx: Ctx, model: str, k: int, n: int, m: int) -> dict:
    """The (K, N) weights with bf16 activations x [M, K]."""
    import jax
    import jax.numpy as jnp
    w = int4_weights(ctx, k, n)
    x = jax.random.normal(jax.random.key(m * 31 + k), (m, k), jnp.bfloat16)
    return {**w, "x": x, "desc": {"model": model, "K": k, "N": n, "M": m,
                                  "group_size": w["group_size"], "copies": w["copies"]}}
