"""Offline throughput benchmark: jaxserve vs HF transformers (and llama.cpp) in one run.

A seeded mixed workload (random token ids, prompt and output lengths uniform in a range, EOS
ignored) goes to jaxserve all at once (continuous batching); HF transformers runs a
deterministic subset of the same workload as static batches of 16 in a subprocess under
.venv-ref (scripts/hf_peer.py). Throughput counts only each request's own generated tokens.
Batch-1 decode: one 32-token prompt -> 128 new tokens on every system.

    .venv/bin/python scripts/bench_throughput.py --quick
    .venv/bin/python scripts/bench_throughput.py --md docs/results/bench_throughput.md \
        --out docs/results/bench_throughput.json

See docs/peers.md for the method and the peers.
"""

from __future__ import annotations

import argparse
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
LLAMA_CPP_PAPER_FIGURE = 71.3  # docs/peers.md: default build of llama-cpp-python 0.3.36, batch 1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--quick", action="store_true",
                    help="32 requests, prompts 32-128, outputs 16-64, batch-1 64 new tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="jaxserve dtype for the throughput run")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30,
                    help="KV cache bytes (4 GiB holds 64 sequences of 1024 fp32 tokens)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="jaxserve K/V storage (auto: the model's dtype)")
    ap.add_argument("--batch1-dtypes", default="float32,bfloat16",
                    help="jaxserve dtypes for the batch-1 decode row (comma separated, or '')")
    ap.add_argument("--also-dtypes", default="",
                    help="comma-separated further jaxserve dtypes run on the full workload "
                    "(float weights, no quantization), e.g. bfloat16 beside --dtype float32")
    ap.add_argument("--quantization", default="",
                    help="comma-separated jaxserve weight paths (w8a8,w8a16,w4a16,gguf) also "
                         "measured, each on the full workload and batch 1, in --dtype")
    ap.add_argument("--batch1-prompt-len", type=int, default=32)
    ap.add_argument("--batch1-new-tokens", type=int, default=128)
    ap.add_argument("--batch1-repeats", type=int, default=2, help="best of N batch-1 runs")
    ap.add_argument("--hf-requests", type=int, default=32,
                    help="HF runs the first N requests of the workload (0: skip HF)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-dtypes", default="float32,bfloat16")
    ap.add_argument("--hf-python", default=str(REPO / ".venv-ref/bin/python"))
    ap.add_argument("--llama-cpp-python", default=None,
                    help="interpreter with llama_cpp importable; else the docs/peers.md figure")
    ap.add_argument("--threads", type=int, default=2, help="threads for the peers")
    ap.add_argument("--async-scheduling", choices=("default", "on", "off"), default="default",
                    help="jaxserve's async_scheduling (default: the engine's default)")
    ap.add_argument("--layer-loop", choices=("auto", "scan", "unrolled"), default="auto",
                    help="jaxserve's layer_loop (EngineConfig)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--md", help="write the report as markdown here")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 32, (32, 128), (16, 64)
        args.batch1_new_tokens = 64
    args.hf_requests = min(args.hf_requests, args.num_requests)
    return args


def batch1_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng([seed, 1]).integers(*TOKEN_RANGE, size=length).tolist()


def environment(args) -> dict:
    import jax
    return {"python": platform.python_version(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)), "load_avg_start": os.getloadavg(),
            "machine": describe(), "model": args.model,
            "dtype": args.dtype, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "kv_cache_dtype": args.kv_cache_dtype,
            "async_scheduling": args.async_scheduling, "layer_loop": args.layer_loop}


# ---- jaxserve ----------------------------------------------------------------------------------

def build_llm(args, dtype: str, quantization: str = "none"):
    from jaxserve import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=dtype, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
              quantization=quantization, kv_cache_dtype=args.kv_cache_dtype,
              **({} if args.layer_loop == "auto" else {"layer_loop": args.layer_loop}),
              **({} if args.async_scheduling == "default" else
                 {"async_scheduling": args.async_scheduling == "on"}))
    build_s = time.perf_counter() - t0
    # The structured-output variants compile after warm-up, on a thread: not while timing.
    llm.engine.wait_until_warm()
    label = dtype + (f" {quantization}" if quantization else "")
    print(f"  jaxserve {label}: constructed in {build_s:.1f}s "
          f"(warm-up compile {llm.engine.warmup_seconds or 0:.1f}s)", flush=True)
    return llm, {"construct_seconds": build_s, "warmup_seconds": llm.engine.warmup_seconds}


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
            "requested_tokens": sum(r["max_tokens"] for r in requests),
            "prompt_tokens": prompt_tokens, "output_tok_s": sum(got) / seconds,
            "prompt_tok_s": prompt_tokens / seconds,
            "ttft_mean_s": float(np.mean(ttft)), "ttft_max_s": float(np.max(ttft)),
            "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
            "num_compiles_after_warmup": after["num_compiles_after_warmup"],
            "kv_blocks_total": after["kv_blocks_total"]}


def jaxserve_batch1(llm, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    from jaxserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    best = None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        n = len(out.outputs[0].token_ids)
        ttft = out.metrics.time_to_first_token
        run = {"seconds": seconds, "ttft_s": ttft, "tok_s": n / seconds,
               "decode_tok_s": (n - 1) / (seconds - ttft), "new_tokens": n,
               "token_ids": list(out.outputs[0].token_ids)}
        if best is None or run["seconds"] < best["seconds"]:
            best = run
    best["num_compiles_after_warmup"] = llm.stats()["num_compiles_after_warmup"]
    return best


def run_jaxserve(args, workload: list[dict], b1_prompt: list[int]) -> dict:
    """Throughput (full workload and the HF subset) in args.dtype, batch-1 in each dtype."""
    result = {"build": {}, "batch1": {}}
    llm, result["build"][args.dtype] = build_llm(args, args.dtype)
    print(f"  jaxserve {args.dtype}: {len(workload)} requests ...", flush=True)
    result["throughput"] = jaxserve_throughput(llm, workload)
    if args.hf_requests:
        print(f"  jaxserve {args.dtype}: HF subset ({args.hf_requests} requests) ...", flush=True)
        result["throughput_hf_subset"] = jaxserve_throughput(llm, workload[:args.hf_requests])
    dtypes = [d for d in args.batch1_dtypes.split(",") if d]
    for dtype in sorted(dtypes, key=lambda d: d != args.dtype):  # reuse the built one first
        if dtype != args.dtype:
            del llm
            llm, result["build"][dtype] = build_llm(args, dtype)
        print(f"  jaxserve {dtype}: batch 1 ...", flush=True)
        result["batch1"][dtype] = jaxserve_batch1(llm, b1_prompt, args.batch1_new_tokens,
                                                  args.batch1_repeats)
    result["also"] = {}
    for dtype in [d for d in args.also_dtypes.split(",") if d and d != args.dtype]:
        del llm
        llm, result["build"][dtype] = build_llm(args, dtype)
        print(f"  jaxserve {dtype}: {len(workload)} requests ...", flush=True)
        result["also"][dtype] = jaxserve_throughput(llm, workload)
    result["quantized"] = {}
    for quant in [q for q in args.quantization.split(",") if q]:
        del llm
        llm, build = build_llm(args, args.dtype, quant)
        print(f"  jaxserve {args.dtype} {quant}: {len(workload)} requests, batch 1 ...",
              flush=True)
        result["quantized"][quant] = {
            "build": build, "throughput": jaxserve_throughput(llm, workload),
            "batch1": jaxserve_batch1(llm, b1_prompt, args.batch1_new_tokens,
                                      args.batch1_repeats)}
    return result


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


def run_hf(args, workload: list[dict], b1_prompt: list[int], model_path: str) -> dict | None:
    if not args.hf_requests and not args.batch1_new_tokens:
        return None
    work = {"model_path": model_path, "threads": args.threads,
            "hf_batch_size": args.hf_batch_size,
            "hf_dtypes": [d for d in args.hf_dtypes.split(",") if d],
            "requests": workload[:args.hf_requests],
            "batch1": {"prompt": b1_prompt, "max_tokens": args.batch1_new_tokens,
                       "dtypes": ["float32", "bfloat16"], "repeats": args.batch1_repeats}}
    print(f"  HF transformers: {args.hf_requests} requests in static batches of "
          f"{args.hf_batch_size}, dtypes {work['hf_dtypes']} ...", flush=True)
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
    if not llama_cpp_usable(args.llama_cpp_python):
        return {"measured": False, "batch1": {"tok_s": LLAMA_CPP_PAPER_FIGURE},
                "note": "not measured in this run: docs/peers.md figure "
                        "(llama-cpp-python 0.3.36, same machine type)"}
    print("  llama.cpp: batch 1 ...", flush=True)
    work = {"model_path": model_path, "threads": args.threads,
            "batch1": {"prompt": b1_prompt, "max_tokens": args.batch1_new_tokens,
                       "repeats": args.batch1_repeats}}
    result = run_peer(args.llama_cpp_python, work, "llama_cpp")
    result["measured"] = True
    return result


# ---- report ------------------------------------------------------------------------------------

def describe_workload(args, requests: list[dict]) -> str:
    p = [len(r["prompt"]) for r in requests]
    o = [r["max_tokens"] for r in requests]
    return (f"{len(requests)} req, prompts {min(p)}-{max(p)} (sum {sum(p)}), "
            f"outputs {min(o)}-{max(o)} (sum {sum(o)})")


def table_rows(args, workload, js: dict, hf: dict | None, lc: dict) -> list[dict]:
    """One row per measurement: system, workload, tok/s, ratio vs the best HF on that kind."""
    full = describe_workload(args, workload)
    sub = describe_workload(args, workload[:args.hf_requests]) if args.hf_requests else ""
    b1 = f"batch 1: {args.batch1_prompt_len}-token prompt -> {args.batch1_new_tokens} new"
    rows = [{"system": f"jaxserve {args.dtype}", "kind": "throughput", "workload": full,
             "tok_s": js["throughput"]["output_tok_s"]}]
    if "throughput_hf_subset" in js:
        rows.append({"system": f"jaxserve {args.dtype}", "kind": "throughput",
                     "workload": f"HF subset: {sub}",
                     "tok_s": js["throughput_hf_subset"]["output_tok_s"]})
    for dtype, r in js.get("also", {}).items():
        rows.append({"system": f"jaxserve {dtype}", "kind": "throughput", "workload": full,
                     "tok_s": r["output_tok_s"]})
    for quant, r in js.get("quantized", {}).items():
        rows.append({"system": f"jaxserve {args.dtype} {quant}", "kind": "throughput",
                     "workload": full, "tok_s": r["throughput"]["output_tok_s"]})
    for dtype, r in ((hf or {}).get("throughput") or {}).items():
        rows.append({"system": f"HF transformers {dtype}, static batches of "
                               f"{args.hf_batch_size}", "kind": "throughput",
                     "workload": f"HF subset: {sub}", "tok_s": r["output_tok_s"]})
    for dtype, r in js["batch1"].items():
        rows.append({"system": f"jaxserve {dtype}", "kind": "batch1", "workload": b1,
                     "tok_s": r["tok_s"]})
    for quant, r in js.get("quantized", {}).items():
        rows.append({"system": f"jaxserve {args.dtype} {quant}", "kind": "batch1",
                     "workload": b1, "tok_s": r["batch1"]["tok_s"]})
    for dtype, r in ((hf or {}).get("batch1") or {}).items():
        rows.append({"system": f"HF transformers {dtype}", "kind": "batch1", "workload": b1,
                     "tok_s": r["tok_s"]})
    label = "llama.cpp (Q4_1 GGUF as shipped)"
    if not lc["measured"]:
        label += " - NOT MEASURED IN THIS RUN (docs/peers.md figure)"
    rows.append({"system": label, "kind": "batch1", "workload": b1,
                 "tok_s": lc["batch1"]["tok_s"], "measured": lc["measured"],
                 "token_ids": lc.get("token_ids")})
    # Greedy agreement with jaxserve float32 (the unquantized reference): the share of the
    # batch-1 positions whose token equals float32's, and where the first difference falls.
    b1_ids = {f"jaxserve {d}": r.get("token_ids") for d, r in js["batch1"].items()}
    b1_ids.update({f"jaxserve {args.dtype} {q}": r["batch1"].get("token_ids")
                   for q, r in js.get("quantized", {}).items()})
    ref = b1_ids.get("jaxserve float32")
    for r in rows:
        ids = r.pop("token_ids", None) or b1_ids.get(r["system"])
        if r["kind"] == "batch1" and ref and ids:
            same = [a == b for a, b in zip(ids, ref)]
            r["agree_f32"] = sum(same) / len(ref)
            r["first_diff_f32"] = same.index(False) if False in same else None
    lc_tok_s = lc["batch1"]["tok_s"] if lc["measured"] else None
    for r in rows:
        if r["kind"] == "batch1" and lc_tok_s:
            r["ratio_vs_llama_cpp"] = r["tok_s"] / lc_tok_s
    for kind in ("throughput", "batch1"):
        hf_best = max((r["tok_s"] for r in rows
                       if r["kind"] == kind and r["system"].startswith("HF")), default=None)
        for r in rows:
            if r["kind"] == kind:
                r["ratio_vs_hf_best"] = r["tok_s"] / hf_best if hf_best else None
    return rows


def render_markdown(args, env: dict, rows: list[dict], js: dict, hf: dict | None) -> str:
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    lines = ["# jaxserve throughput benchmark", "", f"Command: `{cmd}`", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "| system | workload | tok/s | ratio vs HF best | vs llama.cpp | greedy ids = "
             "float32's (first difference) |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio_vs_hf_best']:.2f}x" if r.get("ratio_vs_hf_best") else "-"
        vs_lc = f"{r['ratio_vs_llama_cpp']:.2f}x" if r.get("ratio_vs_llama_cpp") else "-"
        agree = "-"
        if r.get("agree_f32") is not None:
            first = r["first_diff_f32"]
            agree = f"{r['agree_f32']:.0%} ({'none' if first is None else f'at {first}'})"
        lines.append(f"| {r['system']} | {r['workload']} | {r['tok_s']:.1f} | {ratio} | "
                     f"{vs_lc} | {agree} |")
    t = js["throughput"]
    lines += ["", "Notes:",
              f"- tok/s counts only each request's own generated tokens; the ratio compares "
              f"with the best HF row of the same kind (throughput rows with the best HF on the "
              f"HF subset: the first {args.hf_requests} requests of the same workload; HF is too "
              f"slow here for all {args.num_requests}).",
              f"- jaxserve {args.dtype}, full workload: {t['seconds']:.1f}s, prompt "
              f"{t['prompt_tok_s']:.1f} tok/s, mean TTFT {t['ttft_mean_s']:.1f}s, preemptions "
              f"{t['num_preemptions']}, compiles after warm-up "
              f"{t['num_compiles_after_warmup']}, KV blocks {t['kv_blocks_total']}.",
              "- jaxserve construction (warm-up compile) per dtype, not in any timed region: " +
              ", ".join(f"{d} {b['construct_seconds']:.1f}s ({b['warmup_seconds'] or 0:.1f}s)"
                        for d, b in js["build"].items()) + ".",
              "- batch-1 decode-only tok/s (after the first token): " +
              ", ".join(f"jaxserve {d} {r['decode_tok_s']:.1f}" for d, r in js["batch1"].items())
              + "".join(f", HF {d} {r['decode_tok_s']:.1f}"
                        for d, r in ((hf or {}).get("batch1") or {}).items()) + "."]
    for dtype, r in ((hf or {}).get("throughput") or {}).items():
        lines.append(f"- HF {dtype}: {r['seconds']:.1f}s, prompt {r['prompt_tok_s']:.1f} tok/s, "
                     f"{r['tokens_computed_incl_padding']} tokens computed for "
                     f"{r['output_tokens']} requested (static-batch padding).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    from models.registry import model_path
    gguf = str(model_path(args.model)) if args.model == "smollm2-135m" else args.model
    env = environment(args)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print("environment:", json.dumps(env))
    workload = make_workload(args.seed, args.num_requests, args.prompt_len, args.output_len)
    b1_prompt = batch1_prompt(args.seed, args.batch1_prompt_len)
    t0 = time.perf_counter()
    js = run_jaxserve(args, workload, b1_prompt)
    hf = run_hf(args, workload, b1_prompt, gguf)
    lc = run_llama_cpp(args, b1_prompt, gguf)
    env["load_avg_end"] = os.getloadavg()
    env["bench_seconds"] = round(time.perf_counter() - t0, 1)
    rows = table_rows(args, workload, js, hf, lc)
    md = render_markdown(args, env, rows, js, hf)
    print("\n" + md)
    if args.md:
        pathlib.Path(args.md).write_text(md)
    if args.out:
        report = {"command": sys.argv, "environment": env, "rows": rows, "jaxserve": js,
                  "hf": hf, "llama_cpp": lc, "workload_seed": args.seed}
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
