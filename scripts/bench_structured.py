"""Structured-output benchmark: decode step time with 16 constrained requests vs none, and
grammar compile time per JSON schema.

One engine (warmed up: both program variants compiled), three workloads of 16 concurrent
requests run alternately in the same process, `--rounds` times each:

- free: unconstrained, EOS ignored (the asynchronous loop);
- free, synchronous: the same with the engine's asynchronous scheduling off, since a step
  with constrained rows runs synchronously (its next mask needs the ids);
- json: every request constrained to a JSON object with one long string field (minLength
  beyond max_tokens, so all 16 rows run to max_tokens, as the free ones do).

Step time is the wall time of `LLMEngine.step()` over decode-only steps (all 16 decoding);
"mask fill" is the host time llguidance spends filling the 16 rows' bitmasks per step.
Compile time: a fresh compiler (no cache) compiles each of
jaxserve/testing/structured_schemas.py's schemas in turn; the tokenizer's token trie is built
once per engine and reported apart.

    .venv/bin/python scripts/bench_structured.py --md docs/results/bench_structured.md \
        --out docs/results/bench_structured.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.grammar import GrammarCompiler
from jaxserve.core.structured_outputs import StructuredOutputs
from jaxserve.tools.machine import describe

LONG_STRING = {"type": "object", "required": ["story"], "additionalProperties": False,
               "properties": {"story": {"type": "string", "minLength": 2000}}}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--md", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path)
    return ap.parse_args(argv)


class _TimedFill:
    """Wraps the engine's GrammarCompiler.fill to add up the host time of the bitmasks."""

    def __init__(self, grammar):
        self.inner, self.seconds, self.calls = grammar.fill, 0.0, 0

    def __call__(self, mask, rows):
        t = time.perf_counter()
        self.inner(mask, rows)
        self.seconds += time.perf_counter() - t
        self.calls += 1


def run(engine: LLMEngine, params: SamplingParams, n: int, sync: bool, fill: _TimedFill) -> dict:
    engine.config = dataclasses.replace(engine.config, async_scheduling=not sync)
    prompt = "Write a long story about a lighthouse keeper, as JSON:"
    for i in range(n):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt,
                           dataclasses.replace(params, seed=i))
    fill.seconds, fill.calls = 0.0, 0
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        last = engine.last_step
        if last is not None and last.num_decode_seqs == n and last.num_prefill_seqs == 0:
            times.append(dt)
    return {"step_ms": 1e3 * statistics.mean(times[2:] or times), "steps": len(times),
            "mask_fill_ms": 1e3 * fill.seconds / max(fill.calls, 1)}


def sampler_cost(vocab: int, rows: int, iters: int = 30) -> dict:
    """The sampler alone, jitted, without and with a bitmask input (temperature 0.8 rows),
    alternating calls: the device-side cost of the masked variant."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.runtime.sampler import SamplingTensors, sample
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32))  # [S, V]
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(rows)]
    st = SamplingTensors.from_params(params, list(range(rows)), [0] * rows, size=rows)
    hist, lens = jnp.zeros((rows, 8), jnp.int32), jnp.ones((rows,), jnp.int32)
    mask = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, size=(rows, -(-vocab // 32)))
                       .astype(np.int32))  # [S, W]: about half the vocabulary allowed
    fns = {"without mask": jax.jit(lambda lg: sample(lg, st, hist, lens, lens, lens, False)),
           "with mask": jax.jit(lambda lg: sample(lg, st, hist, lens, lens, lens, False,
                                                  mask=mask))}
    times = {name: [] for name in fns}
    for _ in range(iters + 2):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(logits).tokens.block_until_ready()
            times[name].append(1e3 * (time.perf_counter() - t))
    return {name: statistics.median(ts[2:]) for name, ts in times.items()}


def compile_times(engine: LLMEngine) -> dict:
    from jaxserve.testing.structured_schemas import SCHEMAS
    tok = engine.model.tokenizer
    t = time.perf_counter()
    fresh = GrammarCompiler(tok.to_json(), vocab_size=engine.model.config.vocab_size,
                            eos_ids=sorted(engine.eos_ids))
    fresh.compile(StructuredOutputs(choice=["warm"]))  # waits for the token trie
    trie_s = time.perf_counter() - t
    ms = []
    for schema in SCHEMAS:
        t = time.perf_counter()
        fresh.compile(StructuredOutputs(json=schema))
        ms.append(1e3 * (time.perf_counter() - t))
    t = time.perf_counter()
    fresh.compile(StructuredOutputs(json=SCHEMAS[0]))
    cached_ms = 1e3 * (time.perf_counter() - t)
    fresh.close()
    return {"schemas": len(ms), "trie_s": trie_s, "mean_ms": statistics.mean(ms),
            "median_ms": statistics.median(ms), "max_ms": max(ms), "cached_ms": cached_ms}


def main(argv=None) -> dict:
    args = parse_args(argv)
    load0 = os.getloadavg()
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.requests,
                                    max_num_batched_tokens=256, max_model_len=512))
    engine.wait_until_warm()  # the masked variants compile after warm-up: counted here
    warmup_s = time.perf_counter() - t
    fill = _TimedFill(engine.structured.compiler)
    engine.structured.compiler.fill = fill
    free = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True)
    json_ = SamplingParams(temperature=0.8, max_tokens=args.max_tokens,
                           structured_outputs=StructuredOutputs(json=LONG_STRING))
    variants = {"free": (free, False), "free, synchronous": (free, True),
                "json, 16 constrained": (json_, True)}
    results = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (params, sync) in variants.items():
            results[name].append(run(engine, params, args.requests, sync, fill))
    rows = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for name, runs in results.items()}
    report = {"config": vars(args) | {"md": str(args.md), "out": str(args.out)},
              "machine": f"{describe()}, Python {platform.python_version()}",
              "load_before": load0, "load_after": os.getloadavg(), "warmup_s": warmup_s,
              "programs": engine.runner.num_compiled, "rows": rows, "runs": results,
              "compile": compile_times(engine),
              "sampler_ms": sampler_cost(engine.model.config.vocab_size, args.requests),
              "compiles_after_warmup": engine.stats()["num_compiles_after_warmup"]}
    md = markdown(report)
    print(md)
    if args.md:
        args.md.write_text(md)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


def markdown(r: dict) -> str:
    base, sync = r["rows"]["free"]["step_ms"], r["rows"]["free, synchronous"]["step_ms"]
    lines = [f"# Structured outputs: step overhead and compile time ({r['config']['model']})",
             "", f"Python {r['machine']}; load average before {r['load_before']}, after "
             f"{r['load_after']} (a shared machine: compare the ratios, measured in one run, "
             f"workloads alternating, median of {r['config']['rounds']} rounds). "
             f"{r['config']['requests']} concurrent requests, {r['config']['max_tokens']} new "
             f"tokens each; warm-up {r['warmup_s']:.0f} s for {r['programs']} programs; "
             f"compiles after warm-up: {r['compiles_after_warmup']}.", "",
             "| workload | decode step ms | vs free | vs free, synchronous | mask fill ms/step |",
             "|---|---:|---:|---:|---:|"]
    for name, row in r["rows"].items():
        lines.append(f"| {name} | {row['step_ms']:.1f} | {row['step_ms'] / base:.2f}x | "
                     f"{row['step_ms'] / sync:.2f}x | {row['mask_fill_ms']:.2f} |")
    sm = r["sampler_ms"]
    lines += ["", f"The sampler alone (jitted, {r['config']['requests']} rows at temperature 0.8, "
              f"calls alternating, median): {sm['without mask']:.2f} ms without the mask input, "
              f"{sm['with mask']:.2f} ms with it "
              f"({sm['with mask'] / sm['without mask']:.2f}x)."]
    c = r["compile"]
    lines += ["", f"Grammar compile (llguidance, {c['schemas']} JSON schemas of "
              f"jaxserve/testing/structured_schemas.py, no cache): mean {c['mean_ms']:.2f} ms, "
              f"median {c['median_ms']:.2f} ms, max {c['max_ms']:.2f} ms; a cached schema "
              f"{c['cached_ms']:.3f} ms; the token trie, once per engine: {c['trie_s']:.2f} s.",
              "", "Command: `" + " ".join(["scripts/bench_structured.py"] + sys.argv[1:]) + "`",
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
