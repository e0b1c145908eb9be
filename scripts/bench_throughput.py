"""Offline throughput benchmark: jaxserve vs HF transformers and llama.cpp, sides alternated.

A seeded mixed workload (random token ids, prompt and output lengths uniform in a range, EOS
ignored) goes to each jaxserve engine all at once (continuous batching) and to HF transformers
as static batches of 16 in a subprocess under .venv-ref (scripts/hf_peer.py). Throughput counts
only each request's own generated tokens. Batch-1 decode: one 32-token prompt -> 128 new tokens
on every system; llama.cpp runs it on the same GGUF file.

This machine's speed swings (up to 2x within minutes on the VMs we have), so one pass settles
nothing: every side runs once per round, jaxserve's and the peers' in turn, for --rounds rounds,
and the report gives each side's median with its range and each ratio as the median of the
per-round ratios (same round: same machine state) with its range.

Sides: `LLM(model)` with every setting at its default (--defaults), and engines with the
benchmark's settings (max_model_len 1024, a 2 GiB KV cache): --dtype with each of
--quantization, and --also-dtypes (float weights).

    .venv/bin/python scripts/bench_throughput.py --quick
    .venv/bin/python scripts/bench_throughput.py --md docs/results/bench_throughput.md \
        --out docs/results/bench_throughput.json

See docs/peers.md for the method and the peers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxserve.config import KV_CACHE_DTYPES
from jaxserve.tools.workload import TOKEN_RANGE, make_workload  # as `jaxserve bench`
from jaxserve.tools.machine import describe

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--quick", action="store_true",
                    help="16 requests, prompts 32-128, outputs 16-64, batch-1 64 new tokens, "
                         "2 rounds")
    ap.add_argument("--rounds", type=int, default=None,
                    help="every side runs once per round, in turn (medians and ranges over "
                         "them); default 3 (--quick: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="jaxserve dtype of the --quantization sides")
    ap.add_argument("--quantization", default="gguf,w8a8",
                    help="comma-separated jaxserve weight paths (none,gguf,w8a8,w8a16,w4a16,w4a8)"
                         " in --dtype with the benchmark's settings, each a side")
    ap.add_argument("--also-dtypes", default="bfloat16",
                    help="comma-separated further jaxserve dtypes, float weights, the benchmark's"
                         " settings, each a side")
    ap.add_argument("--defaults", action=argparse.BooleanOptionalAction, default=True,
                    help="a side for LLM(model) with every engine setting at its default")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", type=int, default=2 << 30,
                    help="KV cache bytes of the tuned sides (2 GiB holds 45 sequences of 1024 "
                         "float32 tokens; every engine stays alive through the rounds)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="jaxserve K/V storage (auto: the model's dtype)")
    ap.add_argument("--batch1-prompt-len", type=int, default=32)
    ap.add_argument("--batch1-new-tokens", type=int, default=128)
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                    help="HF transformers as a peer (bfloat16 throughput and batch 1, float32 "
                         "batch 1: the greedy reference)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-dtypes", default="bfloat16",
                    help="HF dtypes run on the throughput workload")
    ap.add_argument("--hf-python", default=str(REPO / ".venv-ref/bin/python"))
    ap.add_argument("--llama-cpp-python", default=None,
                    help="interpreter with llama_cpp importable (scripts/setup.sh --peers: "
                         ".venv-ref/bin/python); without it llama.cpp is not measured")
    ap.add_argument("--threads", type=int, default=2, help="threads for the peers")
    ap.add_argument("--async-scheduling", choices=("default", "on", "off"), default="default",
                    help="jaxserve's async_scheduling (default: the engine's default)")
    ap.add_argument("--layer-loop", choices=("auto", "scan", "unrolled"), default="auto",
                    help="jaxserve's layer_loop (EngineConfig)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--md", help="write the report as markdown here")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 16, (32, 128), (16, 64)
        args.batch1_new_tokens = 64
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def batch1_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng([seed, 1]).integers(*TOKEN_RANGE, size=length).tolist()


def environment(args) -> dict:
    import jax
    return {"machine": describe(), "python": platform.python_version(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "cpu_affinity": len(os.sched_getaffinity(0)),
            "load_avg_start": os.getloadavg(), "model": args.model, "rounds": args.rounds,
            "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
            "kv_cache_dtype": args.kv_cache_dtype, "async_scheduling": args.async_scheduling,
            "layer_loop": args.layer_loop}


# ---- jaxserve ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Side:
    """One jaxserve engine of the run: its row label and its LLM keyword arguments."""
    label: str
    kwargs: dict
    defaults: bool = False  # LLM(model) as a user first builds it


def tuned_kwargs(args) -> dict:
    """The benchmark's engine settings (every side but LLM(model)'s defaults)."""
    return dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                kv_cache_dtype=args.kv_cache_dtype,
                **({} if args.layer_loop == "auto" else {"layer_loop": args.layer_loop}),
                **({} if args.async_scheduling == "default" else
                   {"async_scheduling": args.async_scheduling == "on"}))


def jaxserve_sides(args) -> list[Side]:
    tuned = tuned_kwargs(args)
    sides = [Side("jaxserve LLM(model) defaults", {}, defaults=True)] if args.defaults else []
    for quant in [q for q in args.quantization.split(",") if q]:
        sides.append(Side(f"jaxserve {args.dtype} {quant}",
                          dict(tuned, dtype=args.dtype, quantization=quant)))
    for dtype in [d for d in args.also_dtypes.split(",") if d]:
        sides.append(Side(f"jaxserve {dtype}", dict(tuned, dtype=dtype, quantization="none")))
    return sides


def build_llm(args, dtype: str, quantization: str = "none"):
    """An engine with the benchmark's settings (scripts/throughput_step_times.py uses it)."""
    return build(args, Side(f"jaxserve {dtype} {quantization}",
                            dict(tuned_kwargs(args), dtype=dtype, quantization=quantization)))


def build(args, side: Side):
    from jaxserve import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, **side.kwargs)
    build_s = time.perf_counter() - t0
    # The structured-output variants compile after warm-up, on a thread: not while timing.
    llm.engine.wait_until_warm()
    print(f"  {side.label}: constructed in {build_s:.1f}s (warm-up compile "
          f"{llm.engine.warmup_seconds or 0:.1f}s), weights {llm.engine.quantization or 'float'}"
          f", max_model_len {llm.engine.max_model_len}, KV blocks "
          f"{llm.stats()['kv_blocks_total']}", flush=True)
    return llm, {"construct_seconds": build_s, "warmup_seconds": llm.engine.warmup_seconds,
                 "weights": llm.engine.quantization or "float",
                 "max_model_len": llm.engine.max_model_len,
                 "kv_blocks": llm.stats()["kv_blocks_total"]}


def jaxserve_throughput(llm, requests: list[dict]) -> dict:
    """All requests submitted at once; wall time to the last completion."""
    from jaxserve import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in requests]
    llm.reset_prefix_cache()  # like the peers, every pass computes its prompts
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    got = [len(o.outputs[0].token_ids) for o in outs]
    short = [i for i, (g, r) in enumerate(zip(got, requests)) if g != r["max_tokens"]]
    if short:
        print(f"  WARNING: {len(short)} requests got a different token count", flush=True)
    ttft = [o.metrics.time_to_first_token for o in outs]
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    return {"seconds": seconds, "num_requests": len(requests), "output_tokens": sum(got),
            "prompt_tokens": prompt_tokens, "output_tok_s": sum(got) / seconds,
            "prompt_tok_s": prompt_tokens / seconds,
            "ttft_mean_s": float(np.mean(ttft)), "ttft_max_s": float(np.max(ttft)),
            "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
            "num_compiles_after_warmup": after["num_compiles_after_warmup"]}


def jaxserve_batch1(llm, prompt: list[int], new_tokens: int) -> dict:
    from jaxserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    n, ttft = len(out.outputs[0].token_ids), out.metrics.time_to_first_token
    return {"seconds": seconds, "ttft_s": ttft, "tok_s": n / seconds,
            "decode_tok_s": (n - 1) / (seconds - ttft), "new_tokens": n,
            "token_ids": list(out.outputs[0].token_ids),
            "num_compiles_after_warmup": llm.stats()["num_compiles_after_warmup"]}


# ---- peers (subprocesses) ----------------------------------------------------------------------

def run_peer(python: str, work: dict, engine: str, timeout: float = 3600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        win, wout = pathlib.Path(tmp, "workload.json"), pathlib.Path(tmp, "result.json")
        win.write_text(json.dumps(work))
        cmd = [python, str(REPO / "scripts/hf_peer.py"), "--workload", str(win),
               "--out", str(wout), "--engine", engine]
        env = dict(os.environ, OMP_NUM_THREADS=str(work["threads"]),
                   TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(wout.read_text())


def run_hf(args, workload: list[dict], b1_prompt: list[int], model_path: str) -> dict:
    """One HF pass: the workload in each --hf-dtypes, batch 1 in float32 and bfloat16."""
    work = {"model_path": model_path, "threads": args.threads,
            "hf_batch_size": args.hf_batch_size,
            # float32 first: the model is cast in place, and float32 after bfloat16 would run
            # bf16-rounded weights.
            "hf_dtypes": ["float32", *[d for d in args.hf_dtypes.split(",") if d and
                                       d != "float32"]],
            "throughput_dtypes": [d for d in args.hf_dtypes.split(",") if d],
            "requests": workload,
            "batch1": {"prompt": b1_prompt, "max_tokens": args.batch1_new_tokens,
                       "dtypes": ["float32", "bfloat16"], "repeats": 1}}
    return run_peer(args.hf_python, work, "hf")


def llama_cpp_usable(python: str | None) -> bool:
    if not python:
        return False
    try:
        return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_llama_cpp(args, b1_prompt: list[int], model_path: str) -> dict:
    work = {"model_path": model_path, "threads": args.threads,
            "batch1": {"prompt": b1_prompt, "max_tokens": args.batch1_new_tokens,
                       "repeats": 1}}
    result = run_peer(args.llama_cpp_python, work, "llama_cpp")
    result["batch1"]["token_ids"] = result.pop("token_ids")
    return result


# ---- the rounds --------------------------------------------------------------------------------

def run_rounds(args, sides: list[Side], workload, b1_prompt, gguf: str, use_lc: bool) -> dict:
    """results[system][kind] = one measurement per round; builds[label] = each engine's."""
    llms, builds = {}, {}
    results: dict[str, dict[str, list]] = {}
    loads = []

    def add(system: str, kind: str, value: dict) -> None:
        results.setdefault(system, {}).setdefault(kind, []).append(value)

    for rnd in range(args.rounds):
        loads.append(os.getloadavg())
        print(f"round {rnd + 1}/{args.rounds}, load average {loads[-1]}", flush=True)
        for side in sides:
            if side.label not in llms:  # built once, outside any timed region
                llms[side.label], builds[side.label] = build(args, side)
            llm = llms[side.label]
            add(side.label, "throughput", jaxserve_throughput(llm, workload))
            add(side.label, "batch1", jaxserve_batch1(llm, b1_prompt, args.batch1_new_tokens))
            print(f"  {side.label}: {results[side.label]['throughput'][-1]['output_tok_s']:.1f}"
                  f" tok/s, batch 1 {results[side.label]['batch1'][-1]['tok_s']:.1f}",
                  flush=True)
        if args.hf:
            hf = run_hf(args, workload, b1_prompt, gguf)
            for dtype, r in hf["throughput"].items():
                add(f"HF transformers {dtype}", "throughput", r)
            for dtype, r in hf["batch1"].items():
                add(f"HF transformers {dtype}", "batch1", r)
            print("  HF: " + ", ".join(f"{d} {r['output_tok_s']:.1f} tok/s"
                                       for d, r in hf["throughput"].items()), flush=True)
        if use_lc:
            lc = run_llama_cpp(args, b1_prompt, gguf)
            add("llama.cpp (the GGUF file as shipped)", "batch1", lc["batch1"])
            builds["llama.cpp"] = {"version": lc["llama_cpp"], "threads": lc["threads"]}
            print(f"  llama.cpp: batch 1 {lc['batch1']['tok_s']:.1f} tok/s", flush=True)
    loads.append(os.getloadavg())
    return {"results": results, "builds": builds, "load_averages": loads}


# ---- report ------------------------------------------------------------------------------------

def tok_s(m: dict) -> float:
    return m["output_tok_s"] if "output_tok_s" in m else m["tok_s"]


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)),
            "max": float(max(values)), "values": [float(v) for v in values]}


def paired(results: dict, a: str, b: str, kind: str) -> dict | None:
    """a / b per round (both measured in the same round), with median and range."""
    ra, rb = results.get(a, {}).get(kind), results.get(b, {}).get(kind)
    if not ra or not rb:
        return None
    return spread([tok_s(x) / tok_s(y) for x, y in zip(ra, rb)])


def summarize(args, run: dict, sides: list[Side]) -> dict:
    res = run["results"]
    rows = []
    ref = (res.get("HF transformers float32", {}).get("batch1") or [{}])[-1].get("token_ids")
    for system, kinds in res.items():
        for kind, ms in kinds.items():
            row = {"system": system, "kind": kind, "tok_s": spread([tok_s(m) for m in ms])}
            ids = ms[-1].get("token_ids")
            if kind == "batch1" and ref and ids:
                same = [x == y for x, y in zip(ids, ref)]
                row["agree_hf_f32"] = sum(same) / len(ref)
                row["first_diff"] = same.index(False) if False in same else None
            rows.append(row)
    hf_bf16, lc = "HF transformers bfloat16", "llama.cpp (the GGUF file as shipped)"
    pairs = []
    for side in sides:
        pairs.append((side.label, hf_bf16, "throughput"))
    for side in sides:
        pairs.append((side.label, lc, "batch1"))
    default = next((s for s in sides if s.defaults), None)
    if default:
        # The defaults against the tuned engine on the same weight path.
        tuned = next((s for s in sides if not s.defaults and s.kwargs.get("quantization") ==
                      run["builds"][default.label]["weights"]), None)
        if tuned:
            pairs += [(default.label, tuned.label, "throughput"),
                      (default.label, tuned.label, "batch1")]
    ratios = [{"a": a, "b": b, "kind": k, "ratio": r} for a, b, k in pairs
              if (r := paired(res, a, b, k))]
    return {"rows": rows, "ratios": ratios}


def fmt(sp: dict, digits: int = 1, suffix: str = "") -> str:
    return (f"{sp['median']:.{digits}f}{suffix} ({sp['min']:.{digits}f}-"
            f"{sp['max']:.{digits}f})")


def render_markdown(args, env: dict, run: dict, summary: dict, workload) -> str:
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    p = [len(r["prompt"]) for r in workload]
    o = [r["max_tokens"] for r in workload]
    lines = ["# jaxserve throughput benchmark", "", f"Command: `{cmd}`", "",
             f"Machine: **{env['machine']}**. Load average at each round's start: " +
             ", ".join(f"{la[0]:.2f}" for la in run["load_averages"][:-1]) +
             f"; at the end {run['load_averages'][-1][0]:.2f}.", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()
                                         if k not in ("machine",)), "",
             f"Throughput workload: {len(workload)} requests, prompts {min(p)}-{max(p)} (sum "
             f"{sum(p)}), outputs {min(o)}-{max(o)} (sum {sum(o)}), all submitted at once "
             f"(HF: static batches of {args.hf_batch_size}). Batch 1: a "
             f"{args.batch1_prompt_len}-token prompt -> {args.batch1_new_tokens} new tokens.",
             "", f"Each side ran once per round, in turn, for {args.rounds} rounds: medians "
             "(min-max).", "", "## Ratios (median of the per-round ratios, min-max)", "",
             "| kind | system | against | ratio |", "|---|---|---|---|"]
    for r in summary["ratios"]:
        lines.append(f"| {r['kind']} | {r['a']} | {r['b']} | {fmt(r['ratio'], 2, 'x')} |")
    lines += ["", "## Each side (tok/s, median of the rounds, min-max)", "",
              "| system | weights, max_model_len, KV blocks | throughput tok/s | batch 1 tok/s |"
              " batch-1 greedy ids = HF float32's (first difference) |", "|---|---|---|---|---|"]
    by = {}
    for r in summary["rows"]:
        by.setdefault(r["system"], {})[r["kind"]] = r
    for system, kinds in by.items():
        b = run["builds"].get(system)
        build_s = (f"{b['weights']}, {b['max_model_len']}, {b['kv_blocks']}" if b and
                   "weights" in b else "-")
        t, b1 = kinds.get("throughput"), kinds.get("batch1")
        agree = "-"
        if b1 and b1.get("agree_hf_f32") is not None:
            first = b1["first_diff"]
            agree = f"{b1['agree_hf_f32']:.0%} ({'none' if first is None else f'at {first}'})"
        lines.append(f"| {system} | {build_s} | {fmt(t['tok_s']) if t else '-'} | "
                     f"{fmt(b1['tok_s']) if b1 else '-'} | {agree} |")
    lines += ["", "Notes:",
              "- tok/s counts only each request's own generated tokens; batch 1 includes the "
              "prompt's prefill (time to the last token).",
              "- Engines were built once, before their first measurement, and kept: "
              "construction (warm-up compile) is in no timed region: " +
              ", ".join(f"{k} {v['construct_seconds']:.1f}s" for k, v in run["builds"].items()
                        if "construct_seconds" in v) + "."]
    if "llama.cpp" in run["builds"]:
        lc = run["builds"]["llama.cpp"]
        lines.append(f"- llama.cpp: llama-cpp-python {lc['version']} built natively "
                     f"(scripts/setup.sh --peers), {lc['threads']} threads, "
                     "use_extra_bufts off.")
    else:
        lines.append("- llama.cpp: not measured in this run (no --llama-cpp-python).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    from models.registry import model_path
    gguf = str(model_path(args.model)) if args.model == "smollm2-135m" else args.model
    env = environment(args)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print("environment:", json.dumps(env), flush=True)
    workload = make_workload(args.seed, args.num_requests, args.prompt_len, args.output_len)
    b1_prompt = batch1_prompt(args.seed, args.batch1_prompt_len)
    use_lc = llama_cpp_usable(args.llama_cpp_python)
    if args.llama_cpp_python and not use_lc:
        print(f"WARNING: {args.llama_cpp_python} cannot import llama_cpp: llama.cpp is not "
              "measured (scripts/setup.sh --peers builds it)", flush=True)
    sides = jaxserve_sides(args)
    t0 = time.perf_counter()
    run = run_rounds(args, sides, workload, b1_prompt, gguf, use_lc)
    env["load_avg_end"] = os.getloadavg()
    env["bench_seconds"] = round(time.perf_counter() - t0, 1)
    summary = summarize(args, run, sides)
    md = render_markdown(args, env, run, summary, workload)
    print("\n" + md)
    if args.md:
        pathlib.Path(args.md).write_text(md)
    if args.out:
        report = {"command": sys.argv, "environment": env, **summary, **run,
                  "workload_seed": args.seed}
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
