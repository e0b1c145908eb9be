"""Multi-LoRA throughput: 48 requests spread over 8 adapters against the same 48 on the base
model alone, in one run.

The adapters are random PEFT-format adapters for the served model (written to a temporary
directory: rank and targets as given). Three engines run the same seeded workload (random
ids, prompt and output lengths uniform in a range, EOS ignored), alternating, `--repeats`
times each:
- base: the base model, LoRA off (the peer);
- lora: LoRA on, every request with one of the adapters (round robin);
- lora-base: LoRA on, every request on the base model (what enabling LoRA costs others).

    .venv/bin/python scripts/bench_lora.py --md docs/results/bench_lora.md
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile

from jaxserve import EngineConfig, LLMEngine, LoRARequest
from jaxserve.testing.peft_files import write_adapter
from jaxserve.tools.machine import describe
from jaxserve.tools.workload import make_workload, run_workload
from models import load_model
from models.lora_names import LORA_TARGETS


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=8, help="device slots")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(LORA_TARGETS),
                    help="comma-separated projections every adapter adapts")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", type=pathlib.Path, help="write the results table here")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    model = load_model(args.model, "float32")
    common = dict(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=512,
                  max_num_batched_tokens=512)
    workload = make_workload(args.seed, args.num_requests, args.prompt_len, args.output_len)
    load = os.getloadavg()
    header = (f"CPU: {describe()}; load average before: "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as root:
        loras = []
        for i in range(1, args.num_adapters + 1):
            path = pathlib.Path(root) / f"adapter{i}"
            write_adapter(path, model.config, rank=args.rank, targets=targets, seed=i,
                          std=0.02)
            loras.append(LoRARequest(f"adapter{i}", i, str(path)))
        engines = {
            "base": LLMEngine(EngineConfig(**common), model=model),
            "lora": LLMEngine(EngineConfig(enable_lora=True, max_loras=args.max_loras,
                                           max_lora_rank=args.rank, **common), model=model)}
        runs = {"base": [], "lora": [], "lora-base": []}
        with_adapters = [dict(r, lora_request=loras[i % len(loras)])
                         for i, r in enumerate(workload)]
        for engine, requests in ((engines["lora"], with_adapters), (engines["base"], workload)):
            engine.wait_until_warm()  # the structured-output programs compile on a thread
            run_workload(engine, requests[:4])  # first-request paths, adapter loads
        for rep in range(args.repeats):
            for name, engine, requests in (("base", engines["base"], workload),
                                           ("lora", engines["lora"], with_adapters),
                                           ("lora-base", engines["lora"], workload)):
                engine.reset_prefix_cache()
                result = run_workload(engine, requests)
                runs[name].append(result)
                print(f"  {rep}: {name:9s} {result['output_tok_s']:7.1f} output tok/s "
                      f"({result['seconds']:.1f} s, {result['num_compiles']} compiles)",
                      flush=True)
        lora_stats = engines["lora"].stats()["lora"]
    load = os.getloadavg()
    median = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    tokens = runs["base"][0]["output_tokens"]
    lines = [
        f"# Multi-LoRA throughput ({args.model}, float32)", "",
        header + ".", "",
        f"`{' '.join(['scripts/bench_lora.py'] + (argv or []))}`: {args.num_requests} requests "
        f"(prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
        f"{args.output_len[1]} tokens, {tokens} output tokens), {args.num_adapters} random "
        f"adapters of rank {args.rank} on {', '.join(targets)}; {args.max_loras} device slots; "
        f"max_num_seqs {args.max_num_seqs}; medians of {args.repeats} alternating runs.", "",
        "| engine | output tok/s | vs base |", "|---|---:|---:|"]
    for name in ("base", "lora", "lora-base"):
        lines.append(f"| {name} | {median[name]:.1f} | {median[name] / median['base']:.2f}x |")
    lines += ["", f"Adapter loads into device slots: {lora_stats['device_loads']}; "
              f"compiles during the timed runs: "
              f"{sum(r['num_compiles'] for v in runs.values() for r in v)}.",
              f"Load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
