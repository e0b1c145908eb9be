"""Where a jitted step's time goes, at the throughput benchmark's shapes (fixed inputs).

Every step is the runner's one ragged step (jaxserve/runtime/step_layout.py), laid out by
`step_layout.build` and run by `ModelRunner.run`. Times (median of --iters calls, after one
compile call each):
- a decode step (`--rows` rows, every row `--ctx` tokens of context, XLA ragged attention);
- the same step with attention replaced by a stub that only writes K/V (so: linears, norms,
  LM head, sampling); the difference is attention's share;
- attention alone (every layer of the XLA ragged attention, KV write included), the LM head
  alone, sampling alone;
- a prefill step of one `--prefill` token chunk, with and without attention;
- with --mixed, one step of `--rows - 1` decodes and one prefill chunk filling the rest of
  the `--prefill` token budget, with and without attention.

    PYTHONPATH=$PWD .venv/bin/python scripts/profile_step.py --kv-cache-dtype bfloat16

--tiny runs a tiny random model instead of SmolLM2-135M (a smoke test). The machine is
shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime import buckets, step_layout
from jaxserve.runtime.attention import write_kv
from jaxserve.runtime.attention_backends import XlaAttention
from jaxserve.runtime.runner import ModelRunner, StepCall
from jaxserve.runtime.runner_factory import build_runner
from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram
from jaxserve.runtime.sampler import SamplingTensors, sample
from jaxserve.core.sampling_params import SamplingParams
from models.config import ModelConfig

TINY = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
MAX_MODEL_LEN = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoAttention(XlaAttention):
    """The XLA backend's layout, but attention is only the K/V write: out = q."""

    @property
    def name(self) -> str:
        return "none (stub)"

    def attend(self, q, k, v, cache, layer, meta):
        return q, write_kv(cache, layer, k, v, meta.slots)


def timed(fn, iters):
    fn()  # compile
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=350)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mixed", action="store_true", help="also time a decodes + chunk step")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke test)")
    ap.add_argument("--skip", default="", help="comma list of rows to skip: step,stub,attn,"
                    "head,sample,prefill,mixed")
    return ap.parse_args(argv)


class Steps:
    """The profiled steps' layouts over one fixed page table: every decode row has its own
    `ctx` tokens of blocks; the prefill row (slot 0 of a prefill step, the last slot of a
    mixed one) has fresh blocks of its own."""

    def __init__(self, args, max_blocks: int):
        self.args, bs, rows = args, args.block_size, args.rows
        self.per_row = -(-args.ctx // bs)
        self.prefill_blocks = -(-args.prefill // bs)
        self.num_blocks = 1 + rows * self.per_row + self.prefill_blocks + 1  # + the null block
        # [rows + 1, max_blocks]: as runner.page_table, the last row the idle slot (zeros)
        self.decode_table = np.zeros((rows + 1, max_blocks), np.int32)
        self.decode_table[:rows, :self.per_row] = \
            1 + np.arange(rows * self.per_row, dtype=np.int32).reshape(rows, self.per_row)
        self.fresh = 1 + rows * self.per_row + np.arange(self.prefill_blocks, dtype=np.int32)

    def decode(self):
        return [step_layout.Row(slot=r, start=self.args.ctx - 1, tokens=[1], samples=True)
                for r in range(self.args.rows)], self.decode_table

    def prefill(self):
        table = self.decode_table.copy()
        table[0] = 0
        table[0, :self.prefill_blocks] = self.fresh
        return [step_layout.Row(slot=0, start=0, tokens=[1] * self.args.prefill,
                                samples=True)], table

    def mixed(self):
        rows, table = self.decode()
        chunk = max(1, self.args.prefill - (self.args.rows - 1))
        last = self.args.rows - 1
        table = table.copy()
        table[last] = 0
        table[last, :self.prefill_blocks] = self.fresh
        return rows[:last] + [step_layout.Row(slot=last, start=0, tokens=[1] * chunk,
                                              samples=True)], table


def step_call(runner: ModelRunner, rows, table) -> StepCall:
    """The runner's step for `rows` in the smallest token bucket that holds them."""
    need = step_layout.flat_tokens_needed([len(r.tokens) for r in rows], runner.ragged)
    lay = step_layout.build(rows, table, tokens=buckets.pick(runner.token_buckets, need),
                            max_num_seqs=runner.num_slots, block_size=runner.block_size,
                            idle_slot=runner.idle_slot, ragged=runner.ragged)
    return runner.step_call(lay, want_logprobs=False)


def describe(name: str, call: StepCall) -> str:
    meta = call.inputs.meta(ragged=True)
    return (f"{name} (T={call.shape[0]} flat tokens, {int(meta.num_pairs)} pairs of "
            f"{meta.pairs.shape[1]})")


def step_ms(runner, call, iters):
    return timed(lambda: runner.run(call).tokens, iters)


def attention_alone_ms(runner, call, iters):
    """Every layer's XLA ragged attention on the step's metadata, the cache donated and
    threaded through (a write into a cache that is not donated would copy all of it)."""
    c, model = runner.model.config, runner.model
    t = call.shape[0]
    q = jnp.ones((1, t, c.num_heads, c.head_dim), model.dtype)  # [1, T, H, Dh]
    k = jnp.ones((1, t, c.num_kv_heads, c.head_dim), model.dtype)  # [1, T, K, Dh]
    attend = XlaAttention().attend

    @functools.partial(jax.jit, donate_argnums=(0,))
    def attn_all(cache, meta):
        def body(carry, layer):
            acc, cache = carry
            out, cache = attend(q, k, k, cache, layer, meta)
            return (acc + out, cache), None
        (acc, cache), _ = jax.lax.scan(body, (jnp.zeros_like(q), cache),
                                       jnp.arange(c.num_layers))
        return acc, cache

    def run():
        acc, runner.cache = attn_all(runner.cache, call.inputs.meta(ragged=True))
        return acc
    return timed(run, iters)


def model_and_spec(args, num_blocks: int):
    if args.tiny:
        from models.random_init import random_model
        model = random_model(TINY, args.dtype)
    else:
        from models import load_model
        model = load_model("smollm2-135m", args.dtype)
    spec = RunnerSpec(max_num_seqs=args.rows, max_num_batched_tokens=args.prefill,
                      block_size=args.block_size, num_blocks=num_blocks,
                      max_model_len=MAX_MODEL_LEN,
                      program=StepProgram(kv_cache_dtype=args.kv_cache_dtype))
    return model, spec


def step_rows(args, model, spec, steps, skip):
    """The whole-step rows, with the XLA backend and with attention stubbed."""
    out = []
    cases = [("decode", f"decode step, {args.rows} rows", steps.decode, "step", "stub")]
    cases.append(("prefill", f"prefill step, 1x{args.prefill} tokens", steps.prefill,
                  "prefill", "prefill"))
    if args.mixed:
        cases.append(("mixed", f"mixed step, {args.rows - 1} decodes + 1 chunk",
                      steps.mixed, "mixed", "mixed"))
    for attention in (XlaAttention(), NoAttention()):
        stub = isinstance(attention, NoAttention)
        runner = build_runner(model, spec, attention=attention)
        for kind, name, rows_of, full_key, stub_key in cases:
            if (stub_key if stub else full_key) in skip:
                continue
            call = step_call(runner, *rows_of())
            label = (f"  {kind} step with attention stubbed (linears+head+sampling)" if stub
                     else describe(name, call))
            out.append((label, step_ms(runner, call, args.iters)))
            if kind == "decode" and not stub and "attn" not in skip:
                out.append((f"  attention alone ({model.config.num_layers} layers, KV write"
                            "+pairs)", attention_alone_ms(runner, call, args.iters)))
        del runner
    return out


def main(argv=None):
    args = parse_args(argv)
    skip = set(args.skip.split(","))
    steps = Steps(args, -(-MAX_MODEL_LEN // args.block_size))
    model, spec = model_and_spec(args, steps.num_blocks)
    c, rows = model.config, args.rows
    print(f"jax {jax.__version__}, dtype {args.dtype}, kv {args.kv_cache_dtype}, rows {rows}, "
          f"ctx {args.ctx}, block_size {args.block_size}")
    rows_out = step_rows(args, model, spec, steps, skip)
    if "head" not in skip:
        x = jnp.ones((rows, c.hidden_size), model.dtype)
        emb = model.params["embedding"]
        head = jax.jit(lambda x, e: jnp.einsum("BD,VD->BV", x, e,
                                               preferred_element_type=jnp.float32))
        rows_out.append((f"  LM head alone [{rows},{c.hidden_size}]x[{c.vocab_size},"
                         f"{c.hidden_size}]", timed(lambda: head(x, emb), args.iters)))
    if "sample" not in skip:
        logits = jax.random.normal(jax.random.key(0), (rows, c.vocab_size))  # [R, V]
        params = [SamplingParams(temperature=0.0)] * rows  # the benchmark is greedy
        st = SamplingTensors.from_params(params, [1] * rows, [0] * rows, size=rows)
        samp = jax.jit(sample)
        hist = jnp.ones((rows, MAX_MODEL_LEN), jnp.int32)  # [R, L]
        ctx = jnp.full((rows,), args.ctx, jnp.int32)
        rows_out.append(("  sampling alone (greedy)",
                         timed(lambda: samp(logits, st, hist, ctx, ctx // 2, ctx, False).tokens,
                               args.iters)))
    for name, ms in rows_out:
        print(f"{name:72s} {ms:8.1f} ms")
    return rows_out


if __name__ == "__main__":
    main()
