"""Section `kernel_timings`: the kernel cases timed (warm, median) against the nominal and the
measured bandwidth, side by side with the Mosaic GPU versions of the ragged attention, int4
and grouped matmul kernels where they take the case (`mosaic_kernel`,
`kernel_over_mosaic_kernel`: Triton's time over Mosaic's), the XLA paths the engine runs on
the same inputs (its XLA ragged attention over the same rows and pages, laid out by
step_layout.build; for int4 a bf16 dequantize-then-matmul and XLA's native `jnp.int4` dot,
int4_timing.py; the LoRA kernel's tiling in XLA; for the MoE experts' grouped matmul
`jax.lax.ragged_dot`, gmm_timing.py) and the jitted f32 references."""

from __future__ import annotations

import gc

from jaxserve.tools.gpu_check.context import Ctx, next_pow2, rates, run_cases, time_calls
from jaxserve.tools.gpu_check.gmm_timing import time_gmm
from jaxserve.tools.gpu_check.int4_timing import time_int4
from jaxserve.tools.gpu_check.kernel_inputs import attention_case, ragged_step_case
from jaxserve.tools.gpu_check.lora_kernel import time_lora


def xla_step_inputs(page_table, context_lens, block_size: int, query_start=None,
                    num_tokens: int | None = None):
    """The kernel case's rows laid out as the engine lays out a step for its XLA attention
    (step_layout.build with ragged=True: multi-query rows aligned to QUERY_CHUNK, decodes
    packed, the (query, block) pair list and each chunk's pages), over the same pages.

    page_table [R, P], context_lens [R]; query_start [R + 1] and num_tokens (N) for a ragged
    case (packed rows), None for a decode case (one query per row). Rows of no query or no
    context, and tokens of no row, go to idle flat tokens. Returns (PagedMeta as the runner
    builds it, flat_index [N] int32: the flat token each case token is at, pairs in use).
    """
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.runtime import buckets, step_layout
    from jaxserve.runtime.kv_cache import PagedMeta
    table, lens = np.asarray(page_table), np.asarray(context_lens)
    qs = np.arange(len(lens) + 1) if query_start is None else np.asarray(query_start)
    n_tokens = num_tokens or int(qs[-1])
    live = [r for r in range(len(lens)) if qs[r + 1] > qs[r] and lens[r] > 0]
    rows = [step_layout.Row(slot=r, start=int(lens[r] - qs[r + 1] + qs[r]),
                            tokens=[0] * int(qs[r + 1] - qs[r]), samples=True) for r in live]
    idle = np.zeros((1, table.shape[1]), table.dtype)  # the idle slot's row: the null block
    slots = np.concatenate([table, idle])  # [R + 1, P]
    owned = sum(len(row.tokens) for row in rows)
    need = step_layout.flat_tokens_needed([len(row.tokens) for row in rows]) + n_tokens - owned
    tokens = buckets.pick(step_layout.token_buckets(next_pow2(need), max(len(rows), 1)), need)
    lay = step_layout.build(rows, slots, tokens=tokens, max_num_seqs=max(len(rows), 1),
                            block_size=block_size, idle_slot=len(lens), ragged=True)
    flat = np.full((n_tokens,), -1, np.int64)
    for i, r in enumerate(live):
        at = lay.query_start[lay.row_index[i]]
        flat[qs[r]:qs[r + 1]] = np.arange(at, at + qs[r + 1] - qs[r])
    orphans = np.flatnonzero(flat < 0)
    flat[orphans] = lay.query_start[-1] + np.arange(orphans.size)
    r_ = lay.context_lens.shape[0]
    meta = PagedMeta(positions=jnp.asarray(lay.positions[None]),
                     slots=jnp.asarray(lay.write_slots[None]),
                     query_start=jnp.asarray(lay.query_start),
                     context_lens=jnp.asarray(lay.context_lens),
                     page_table=jnp.zeros((r_, 1), jnp.int32), pairs=jnp.asarray(lay.pairs),
                     num_pairs=jnp.asarray(lay.num_pairs), multi=jnp.asarray(lay.multi),
                     chunk_pages=jnp.asarray(lay.chunk_pages))
    return meta, jnp.asarray(flat, jnp.int32), int(lay.num_pairs)


def xla_engine_attention():
    """The engine's XLA attention (jaxserve/runtime/attention.py `ragged_attention_xla`, what
    the XlaAttention backend runs) on the kernel's inputs, less its KV write (the kernel does
    not write either, and a write into a cache that is not donated would copy all of it).
    Returns fn(q, k, v, layer, meta, flat_index) -> the case's tokens' outputs `[N, H, Dh]`;
    tests/tools/test_gpu_check.py checks it against ragged_attention_xla itself."""
    import jax
    import jax.numpy as jnp
    from jaxserve.runtime import attention
    from jaxserve.runtime.kv_cache import KVCache
    from jaxserve.runtime.step_layout import QUERY_CHUNK

    @jax.jit
    def fn(q, k_cache, v_cache, layer, meta, flat_index):
        cache = KVCache(k=k_cache, v=v_cache)
        qf = jnp.zeros((meta.positions.shape[1],) + q.shape[1:], q.dtype)  # [T, H, Dh]
        qf = qf.at[flat_index].set(q)
        logits = attention._Logits(None, None, None)  # no window, soft-cap or query scale
        out = attention._single_query_attention(qf, cache, layer, meta, True, logits)
        if qf.shape[0] >= QUERY_CHUNK:  # as ragged_attention_xla: no multi rows below
            chunked = attention._chunked_attention(qf, cache, layer, meta, logits)
            out = jnp.where(meta.multi[:, None, None], chunked, out)
        return out[flat_index].astype(q.dtype)  # [N, H, Dh]
    return fn


def time_attention(ctx: Ctx, model: str, block: int, batch: int) -> dict:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    c = attention_case(ctx, model, block, batch)
    p = ctx.prof
    sets = [(c["q"], c["k"], c["v"], jnp.int32(i), c["page_table"], c["context_lens"])
            for i in range(c["layers"])]
    meta, flat, in_use = xla_step_inputs(c["page_table"], c["context_lens"], block)
    xla_sets = [(c["q"], c["k"], c["v"], jnp.int32(i), meta, flat) for i in range(c["layers"])]

    def kernel(*a):
        return paged_attention(*a, interpret=p.interpret)

    impls = {"kernel": (kernel, sets), "xla_engine_path": (xla_engine_attention(), xla_sets),
             "reference_f32": (jax.jit(paged_attention_reference), sets)}
    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"], "layers_cycled": c["layers"],
           "xla_pairs": in_use, "xla_pair_capacity": int(meta.pairs.shape[1]),
           "xla_flat_tokens": int(meta.positions.shape[1])}
    for name, (fn, args) in impls.items():
        t = time_calls(fn, args, p.iters, p.reps)
        row[name] = {**rates(ctx, t["median_s"], c["bytes_per_call"]),
                     "first_call_s": t["first_call_s"]}
    for name in ("xla_engine_path", "reference_f32"):
        row[f"kernel_over_{name}"] = row["kernel"]["median_s"] / row[name]["median_s"]
    return row


def time_ragged(ctx: Ctx, model: str, block: int, max_ctx: int, decode: int) -> dict:
    """The Triton kernel against the Mosaic GPU one, the engine's XLA path on the same rows
    and pages (laid out as the engine lays out a step for it) and the jitted f32 reference;
    then both kernels on the same cache quantized to int8 (`*_int8`: half the bytes, plus
    the f32 scales); bytes = each visible page read once."""
    import jax
    import jax.numpy as jnp
    from jaxserve.runtime import kv_quant
    from pallas_kernels import ragged_paged_attention_mgpu as mgpu
    from pallas_kernels.mosaic_interpret import interpret_stall, mosaic_interpret
    from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                       ragged_paged_attention_reference)
    c = ragged_step_case(ctx, model, block, max_ctx, decode)
    q, k, v, table, qs, lens = c["args"]
    sets = [(q, k, v, jnp.int32(i), table, qs, lens) for i in range(c["layers"])]
    meta, flat, in_use = xla_step_inputs(table, lens, block, qs, q.shape[0])
    xla_sets = [(q, k, v, jnp.int32(i), meta, flat) for i in range(c["layers"])]

    def kernel(*a):
        return ragged_paged_attention(*a, interpret=ctx.prof.interpret)

    def mosaic(*a):
        return mgpu.ragged_paged_attention_mgpu(*a,
                                                interpret=mosaic_interpret(ctx.prof.interpret))

    (kc, ks), (vc, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
    int8_sets = [(q, kc, vc, *a[3:]) for a in sets]
    scales = dict(k_scale=ks, v_scale=vs)
    head_dim = q.shape[2]
    int8_bytes = c["bytes_per_call"] * (head_dim + 4) // (2 * head_dim)

    def kernel_int8(*a):
        return ragged_paged_attention(*a, **scales, interpret=ctx.prof.interpret)

    def mosaic_int8(*a):
        return mgpu.ragged_paged_attention_mgpu(
            *a, **scales, interpret=mosaic_interpret(ctx.prof.interpret))

    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"], "layers_cycled": c["layers"],
           "xla_pairs": in_use, "xla_flat_tokens": int(meta.positions.shape[1])}
    impls = {"kernel": (kernel, sets), "xla_engine_path": (xla_engine_attention(), xla_sets),
             "reference_f32": (jax.jit(ragged_paged_attention_reference), sets)}
    why = mgpu.unsupported(q.shape[1], k.shape[3], q.shape[2], k.shape[2], q.dtype,
                           kv_dtype=k.dtype) or interpret_stall(ctx.prof.interpret,
                                                                q.shape[1] // k.shape[3] + 1)
    impls["kernel_int8"] = (kernel_int8, int8_sets)
    if why is None:  # the Mosaic GPU kernel beside the Triton one ("kernel")
        impls["mosaic_kernel"] = (mosaic, sets)
        impls["mosaic_kernel_int8"] = (mosaic_int8, int8_sets)
    else:
        row["mosaic_kernel_unsupported"] = why
    for name, (fn, args) in impls.items():
        # Interpreted, a Mosaic call takes ~20 s of simulated warpgroups and its time means
        # nothing: one sample exercises the row (a dry run).
        once = name.startswith("mosaic_kernel") and ctx.prof.interpret
        t = time_calls(fn, args, *((1, 1) if once else (ctx.prof.iters, ctx.prof.reps)))
        row[name] = {**rates(ctx, t["median_s"], int8_bytes if name.endswith("int8")
                             else c["bytes_per_call"]),
                     "first_call_s": t["first_call_s"]}
    for name in ("xla_engine_path", "reference_f32", "mosaic_kernel")[:2 + (why is None)]:
        row[f"kernel_over_{name}"] = row["kernel"]["median_s"] / row[name]["median_s"]
    if why is None:
        row["kernel_int8_over_mosaic_kernel_int8"] = (row["kernel_int8"]["median_s"]
                                                      / row["mosaic_kernel_int8"]["median_s"])
    return row


def section_kernel_timings(ctx: Ctx) -> dict:
    try:
        attn, s1 = run_cases(ctx, ctx.prof.attn_cases, time_attention, "attention timing")
        int4, s2 = run_cases(ctx, ctx.prof.int4_cases, time_int4, "int4 timing")
        ragged, s3 = run_cases(ctx, ctx.prof.ragged_cases, time_ragged, "ragged timing")
        lora, s4 = run_cases(ctx, ctx.prof.lora_cases, time_lora, "lora timing")
        gmm, s5 = run_cases(ctx, ctx.prof.gmm_cases, time_gmm, "grouped matmul timing")
    finally:
        ctx.cases.clear()
        gc.collect()
    skipped = s1 + s2 + s3 + s4 + s5
    res = {"paged_attention": attn, "int4_matmul": int4, "ragged_attention": ragged,
           "lora_sgmv": lora, "grouped_matmul": gmm,
           "method": f"median of {ctx.prof.reps} samples of {ctx.prof.iters} back-to-back "
                     "calls (inputs cycled to exceed L2), one block_until_ready per sample; "
                     "bytes = K+V pages read (attention), packed + scales + offsets (int4; "
                     "its jnp.int4 baseline: codes + bf16 scales + offsets), x + used "
                     "adapters' a and b + f32 result (lora), the Mosaic GPU kernel's cost() "
                     "(grouped matmul: weights of min(E, M) experts, padded x, item outputs "
                     "and their gather)"}
    if skipped:
        res["skipped_cases"] = skipped
    if any("error" in r for r in attn + int4 + ragged + lora + gmm):
        res["_status"] = "failed"
    elif skipped or any("skipped_baselines" in r for r in int4 + gmm):
        res.update(_status="partial", _reason=skipped[0]["reason"] if skipped else
                   "baselines skipped: time budget")
    return res
