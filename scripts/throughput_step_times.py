"""Where bench_throughput.py's mixed workload spends its time, by step kind and batch size.

    .venv/bin/python scripts/throughput_step_times.py [QUANTIZATION|none] [KV_CACHE_DTYPE]

Builds the engine as bench_throughput.py does (float32, its default 48-request workload: prompts
32-256, outputs 32-128, all submitted at once), runs the workload twice and prints, for the
second run, the total seconds and per (step kind, decoding rows) the steps, seconds, ms per
step and tokens sampled. The machine must be quiet for the figures to mean anything.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import bench_throughput as bt
from jaxserve import SamplingParams
from jaxserve.telemetry.step_stats import timed_steps
from jaxserve.tools.workload import make_workload


def rows_bucket(rows: int) -> str:
    return "1-4" if rows <= 4 else "5-16" if rows <= 16 else "17-32" if rows <= 32 else "33-64"


def main(argv: list[str]) -> None:
    quant = argv[0] if argv else "w8a8"
    kv = argv[1] if len(argv) > 1 else "auto"
    args = bt.parse_args(["--num-requests", "48", "--prompt-len", "32", "256", "--output-len",
                          "32", "128", "--dtype", "float32", "--kv-cache-dtype", kv])
    llm, _ = bt.build_llm(args, "float32", quant)
    workload = make_workload(args.seed, args.num_requests, args.prompt_len, args.output_len)
    engine = llm.engine
    for rnd in range(2):
        llm.reset_prefix_cache()
        for i, r in enumerate(workload):
            engine.add_request(f"q{rnd}-{i}", r["prompt"], SamplingParams(
                temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
        agg = collections.defaultdict(lambda: [0, 0.0, 0])
        start = time.perf_counter()
        for wall, s in timed_steps(engine):
            kind = ("prefill+dec" if s.num_prefill_seqs and s.num_decode_seqs
                    else "prefill" if s.num_prefill_seqs else "decode")
            a = agg[(kind, rows_bucket(s.num_decode_seqs))]
            a[0], a[1], a[2] = a[0] + 1, a[1] + wall, a[2] + s.num_sampled
        total = time.perf_counter() - start
    print(f"total {total:.2f}s")
    for key, (n, secs, tokens) in sorted(agg.items()):
        print(key, n, f"{secs:.2f}s {secs / n * 1e3:.1f} ms/step, {tokens} tokens")
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main(sys.argv[1:])
