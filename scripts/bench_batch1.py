"""Batch-1 decode only: jaxserve paths side by side in one process (no throughput workload).

    .venv/bin/python scripts/bench_batch1.py --quantization gguf,w4a8,w4a16,w8a8,none

Each path: one LLM (`--dtype`, float32 by default; bench_throughput.py's engine settings), bench_throughput.py's
seeded 32-token prompt -> `--new-tokens` greedy tokens, EOS ignored, best of `--repeats`.
Prints wall tok/s and tokens per second of process CPU time (steadier than wall time on a
shared machine: compare both), the load average, and compiles after warm-up. See
docs/performance.md, "Where a step's time goes (CPU)".
"""

from __future__ import annotations

import argparse
import os
import time

from bench_throughput import batch1_prompt
from jaxserve.tools.machine import describe


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="gguf,w4a8,none",
                    help="comma-separated paths; 'none' is the float model")
    ap.add_argument("--linear-backend", default="auto")
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from jaxserve import LLM, SamplingParams
    prompt = batch1_prompt(args.seed, 32)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"machine: {describe()}; load average at start {os.getloadavg()}")
    for path in args.quantization.split(","):
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, block_size=16, max_num_seqs=64,
                  max_num_batched_tokens=512, max_model_len=1024, kv_cache_memory=1 << 30,
                  quantization=path,
                  linear_backend=args.linear_backend, layer_loop=args.layer_loop)
        llm.engine.wait_until_warm()
        build = time.perf_counter() - t0
        best = None
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            c0, w0 = time.process_time(), time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            n = len(out.outputs[0].token_ids)
            if best is None or n / wall > best[0]:
                best = (n / wall, n / cpu)
        print(f"{path:6s} {best[0]:7.1f} tok/s wall  {best[1]:7.1f} tok per CPU-second  "
              f"(built in {build:.0f}s; load {os.getloadavg()[0]:.1f}; compiles after warm-up "
              f"{llm.stats()['num_compiles_after_warmup']})", flush=True)
        del llm


if __name__ == "__main__":
    main()
