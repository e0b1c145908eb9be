"""Prefix sharing benchmark: prefill work, KV blocks in use and throughput, sharing on vs off.

Two seeded workloads, each run in the same process with sharing on and off:

1. shared system prompt: every request is one long system prompt plus its own short question
   (random token ids), greedy, EOS ignored; automatic prefix caching on vs off.
2. parallel sampling: a few prompts, each asking for n completions (temperature 1, seeded);
   `SamplingParams(n=k)` (prompt prefilled once, k branches forked on its blocks, copy-on-write
   tail) vs the same work as k independent requests with caching off (no sharing at all).

All requests are submitted at once and the KV cache holds them all, so the scheduler never
preempts and the peak of blocks in use is the memory each way needs. "KV saving" is
1 - peak(shared) / peak(unshared); the vLLM paper reports up to 55% for parallel sampling.

    .venv/bin/python scripts/bench_prefix_cache.py --md docs/results/bench_prefix_cache.md \
        --out docs/results/bench_prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import sys
import time

import numpy as np

TOKEN_RANGE = (100, 40000)  # ordinary tokens, no specials


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--parallel-prompts", type=int, default=8)
    ap.add_argument("--parallel-prompt-len", type=int, default=256)
    ap.add_argument("--parallel-n", type=int, nargs="+", default=(4, 8))
    ap.add_argument("--parallel-output-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--md", help="write the report as markdown here")
    return ap.parse_args(argv)


def run(engine, requests) -> dict:
    """requests: (prompt ids, SamplingParams). All submitted at once; steps to the end."""
    from jaxserve import SamplingParams  # noqa: F401  (engine import done by the caller)
    before = engine.stats()
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"q{i}", ids, params)
    in_use, generated, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        in_use.append(engine.stats()["kv_blocks_in_use"])
    wall = time.perf_counter() - start
    after = engine.stats()
    diff = {k: after[k] - before[k] for k in (
        "prompt_tokens_computed", "tokens_computed", "prefix_cache_hits_tokens",
        "prefix_cache_queries_tokens", "cow_copies", "num_preemptions")}
    return dict(diff, wall_s=wall, generated_tokens=generated, tok_per_s=generated / wall,
                peak_blocks=max(in_use), mean_blocks=float(np.mean(in_use)), steps=len(in_use),
                compiles_after_warmup=after["num_compiles_after_warmup"])


def make_engine(args, model, caching: bool):
    from jaxserve import EngineConfig, LLMEngine
    config = EngineConfig(model=model.source, dtype=args.dtype, block_size=args.block_size,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                          enable_prefix_caching=caching)
    engine = LLMEngine(config, model=model)
    engine.wait_until_warm()  # the structured-output variants compile after warm-up
    return engine


def shared_system_workload(args, rng):
    from jaxserve import SamplingParams
    system = rng.integers(*TOKEN_RANGE, args.system_len).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    return [(system + rng.integers(*TOKEN_RANGE, int(rng.integers(args.question_len[0],
                                                                  args.question_len[1] + 1))
                                   ).tolist(), params)
            for _ in range(args.num_requests)]


def parallel_workloads(args, rng, n):
    from jaxserve import SamplingParams
    prompts = [rng.integers(*TOKEN_RANGE, args.parallel_prompt_len).tolist()
               for _ in range(args.parallel_prompts)]
    forked = [(p, SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=args.parallel_output_len,
                                 ignore_eos=True)) for i, p in enumerate(prompts)]
    separate = [(p, SamplingParams(temperature=1.0, seed=i * 1000 + j,
                                   max_tokens=args.parallel_output_len, ignore_eos=True))
                for i, p in enumerate(prompts) for j in range(n)]
    return forked, separate


def main(argv=None) -> int:
    args = parse_args(argv)
    from models import load_model
    t0 = time.perf_counter()
    model = load_model(args.model, args.dtype)
    engines = {}
    for caching in (True, False):
        engines[caching] = make_engine(args, model, caching)
    setup_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    rows = []
    work = shared_system_workload(args, rng)
    for caching in (False, True):
        rows.append(dict(workload=f"{args.num_requests} requests, {args.system_len}-token "
                                  f"shared system prompt", way="prefix caching" if caching
                         else "no caching", **run(engines[caching], work)))
    for n in args.parallel_n:
        forked, separate = parallel_workloads(args, rng, n)
        name = (f"{args.parallel_prompts} prompts x n={n}, {args.parallel_prompt_len}-token "
                f"prompts, {args.parallel_output_len} new")
        rows.append(dict(workload=name, way=f"{n} separate requests, no caching",
                         **run(engines[False], separate)))
        rows.append(dict(workload=name, way=f"n={n} fork, caching off",
                         **run(engines[False], forked)))
        rows.append(dict(workload=name, way=f"n={n} fork + prefix caching",
                         **run(engines[True], forked)))
    env = dict(command="python " + " ".join(shlex.quote(a) for a in [
        "scripts/bench_prefix_cache.py", *(argv if argv is not None else sys.argv[1:])]),
        platform=platform.platform(), cpus=os.cpu_count(), setup_s=setup_s,
        jax=__import__("jax").__version__, device=str(__import__("jax").devices()[0]),
        kv_bytes_per_token=model.config.kv_bytes_per_token(np.dtype(args.dtype).itemsize))
    report = render(rows, args, env)
    print(report)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    if args.md:
        pathlib.Path(args.md).write_text(report)
    return 0


def render(rows, args, env) -> str:
    lines = [
        "# Prefix sharing: caching and forking on vs off (one run)", "",
        f"`{env['command']}`", "",
        f"{args.model} {args.dtype}, block_size {args.block_size}, max_num_seqs "
        f"{args.max_num_seqs}, {args.kv_cache_memory >> 20} MiB KV cache, {env['device']}, "
        f"jax {env['jax']}, {env['cpus']} CPUs ({env['platform']}).", "",
        "| workload | way | prompt tokens computed | peak KV blocks | mean KV blocks | "
        "KV saving (peak) | tok/s | speed-up | cache hit tokens | CoW copies |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        b = base.setdefault(r["workload"], r)
        lines.append(
            f"| {r['workload']} | {r['way']} | {r['prompt_tokens_computed']} | "
            f"{r['peak_blocks']} | {r['mean_blocks']:.0f} | "
            f"{1 - r['peak_blocks'] / b['peak_blocks']:.0%} | {r['tok_per_s']:.1f} | "
            f"{r['tok_per_s'] / b['tok_per_s']:.2f}x | {r['prefix_cache_hits_tokens']} | "
            f"{r['cow_copies']} |")
    lines += ["", "Peak/mean KV blocks: blocks referenced by a running sequence, sampled after "
              "every step (cached blocks nobody references are free memory and not counted). "
              "Ratios are against the first row of each workload. Preemptions: "
              f"{sum(r['num_preemptions'] for r in rows)}; compiles after warm-up: "
              f"{max(r['compiles_after_warmup'] for r in rows)}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
