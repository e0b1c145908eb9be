"""Where a jitted step's time goes, at the throughput benchmark's shapes (fixed inputs).

Times (median of --iters calls, after one compile call each):
- the whole decode step (64 rows, every row `--ctx` tokens of context, XLA ragged attention);
- the same step with attention replaced by a stub that only writes K/V (so: linears, norms,
  LM head, sampling); the difference is attention's share;
- attention alone (30 layers of the ragged decode attention), the LM head alone, sampling alone;
- a prefill step of one `--prefill` token prompt, with and without attention.

    PYTHONPATH=$PWD .venv/bin/python scripts/profile_step.py --kv-cache-dtype bfloat16

The machine is shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime import buckets
from jaxserve.runtime.attention import ragged_decode_attention, write_kv
from jaxserve.runtime.attention_backends import XlaAttention
from jaxserve.runtime.kv_cache import PagedMeta
from jaxserve.runtime.runner import ModelRunner, StepCall, StepInputs
from jaxserve.runtime.sampler import SamplingTensors, sample
from jaxserve.core.sampling_params import SamplingParams
from models import load_model


def timed(fn, iters):
    fn()  # compile
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def no_attention(q, k, v, cache, layer, meta):
    return q, write_kv(cache, layer, k, v, meta.slots)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=350)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma list of rows to skip: step,stub,attn,"
                    "head,sample,prefill")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    model = load_model("smollm2-135m", args.dtype)
    c, bs, rows = model.config, args.block_size, args.rows
    per_row = -(-args.ctx // bs)
    num_blocks = rows * per_row + 2
    kw = dict(max_num_seqs=rows, max_num_batched_tokens=args.prefill, block_size=bs,
              num_blocks=num_blocks, max_model_len=1024)
    if args.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    print(f"jax {jax.__version__}, dtype {args.dtype}, kv {args.kv_cache_dtype}, rows {rows}, "
          f"ctx {args.ctx}, block_size {bs}")

    def decode_inputs(runner):
        table = 1 + np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
        runner.page_table[:, :per_row] = table
        ctx = np.full((rows,), args.ctx, np.int32)
        pos = (ctx - 1)[:, None]
        slots = (table[:, -1:] * bs + (args.ctx - 1) % bs).astype(np.int32)
        pages = runner._decode_pages(np.arange(rows), ctx, rows)
        meta = PagedMeta(positions=pos, slots=slots, context_lens=ctx, **pages)
        ragged = pages.get("ragged")
        p = "-" if ragged is None else ragged.shape[1]
        inp = StepInputs(tokens=np.ones((rows, 1), np.int32), meta=meta,
                         logits_index=np.zeros((rows,), np.int32),
                         history=np.ones((rows, 1024), np.int32),
                         prompt_lens=np.full((rows,), args.ctx // 2, np.int32),
                         sample_pos=ctx, want_logprobs=np.bool_(False))
        params = [SamplingParams(temperature=0.0)] * rows  # the benchmark is greedy
        st = SamplingTensors.from_params(params, [1] * rows, [0] * rows, size=rows)
        return inp, st, p

    def step_ms(runner, inp, st):
        def call():
            return runner.run(StepCall(inp, st)).tokens
        return timed(call, args.iters)

    def prefill_inputs(runner):
        n = args.prefill
        nb = -(-n // bs)
        runner.page_table[0, :nb] = 1 + np.arange(nb)
        positions = np.arange(n, dtype=np.int32)[None]
        slots = (runner.page_table[0, positions[0] // bs] * bs + positions[0] % bs)[None]
        meta = PagedMeta(positions=positions, slots=slots.astype(np.int32),
                         page_table=runner.page_table[:1, :nb],
                         context_lens=np.array([n], np.int32))
        inp = StepInputs(tokens=np.ones((1, n), np.int32), meta=meta,
                         logits_index=np.array([n - 1], np.int32),
                         history=np.ones((1, 1024), np.int32),
                         prompt_lens=np.array([n], np.int32), sample_pos=np.array([n], np.int32),
                         want_logprobs=np.bool_(False))
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0)], [1], [0], size=1)
        return inp, st

    rows_out = []
    runner = ModelRunner(model, attention=XlaAttention(), **kw)
    inp, st, p = decode_inputs(runner)
    if "step" not in skip:
        rows_out.append((f"decode step, {rows} rows, P={p} blocks", step_ms(runner, inp, st)))
    if "prefill" not in skip:
        pin, pst = prefill_inputs(runner)
        rows_out.append((f"prefill step, 1x{args.prefill} tokens", step_ms(runner, pin, pst)))
    if "attn" not in skip:
        q = jnp.ones((rows, 1, c.num_heads, c.head_dim), model.dtype)
        meta = inp.meta

        @jax.jit
        def attn_all(cache, q):
            def body(acc, layer):
                return acc + ragged_decode_attention(q, cache, layer, meta), None
            return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(c.num_layers))[0]
        rows_out.append((f"  attention alone (30 layers, gather+softmax+PV, P={p})",
                         timed(lambda: attn_all(runner.cache, q), args.iters)))
    del runner
    stub = ModelRunner(model, attention=no_attention, **kw)
    if "stub" not in skip:
        sinp, sst, _ = decode_inputs(stub)
        rows_out.append(("  decode step with attention stubbed (linears+head+sampling)",
                         step_ms(stub, sinp, sst)))
    if "prefill" not in skip:
        pin, pst = prefill_inputs(stub)
        rows_out.append(("  prefill step with attention stubbed", step_ms(stub, pin, pst)))
    del stub
    if "head" not in skip:
        x = jnp.ones((rows, c.hidden_size), model.dtype)
        emb = model.params["embedding"]
        head = jax.jit(lambda x, e: jnp.einsum("BD,VD->BV", x, e,
                                               preferred_element_type=jnp.float32))
        rows_out.append((f"  LM head alone [{rows},{c.hidden_size}]x[{c.vocab_size},"
                         f"{c.hidden_size}]", timed(lambda: head(x, emb), args.iters)))
    if "sample" not in skip:
        logits = jax.random.normal(jax.random.key(0), (rows, c.vocab_size))
        _, st, _ = decode_inputs(ModelRunner(model, attention=no_attention,
                                             **{**kw, "num_blocks": 2 + rows * per_row}))
        samp = jax.jit(sample)
        hist = jnp.ones((rows, 1024), jnp.int32)
        ctx = jnp.full((rows,), args.ctx, jnp.int32)
        rows_out.append(("  sampling alone (greedy)",
                         timed(lambda: samp(logits, st, hist, ctx, ctx // 2, ctx, False).tokens,
                               args.iters)))
    for name, ms in rows_out:
        print(f"{name:72s} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
