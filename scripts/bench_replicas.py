"""Replicas on Ray Serve: prefix-aware routing against round-robin, and the Ray path's overhead.

Part 1, shared prefixes: `--systems` system prompts x `--users` users (each user's request is
a system prompt plus a short question of its own), sent `--concurrency` at a time to
`jaxserve serve --data-parallel-size 2`, once with `--router prefix` and once with
`--router round_robin`, in the same run. Reported: the pool's prefix-cache hit rate (prompt
tokens found cached / looked up, from /metrics), preemptions and TTFT p50/p99, at two KV cache
sizes per replica (`--kv-cache-mib`): one where only about half the system prompts fit beside
a full batch (where routing decides what gets evicted) and one where all of them fit.

Part 2, overhead: the plain server (one engine in the HTTP process) against the Ray path with
one replica (`--data-parallel-size 1`), same workload of distinct prompts, alternating
`--repeats` times; TTFT and inter-token latency p50 and their ratio.

    python scripts/bench_replicas.py --out docs/results/bench_replicas.md
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import requests

from bench_serving import WORDS, Result, read_stream
from jaxserve.tools.machine import describe

STARTUP_TIMEOUT_S = 600


class Server:
    """`jaxserve serve` in a subprocess, listening on a free port, stopped with SIGTERM."""

    def __init__(self, args, *extra: str):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", args.model, "--port", "0",
               "--served-model-name", "bench", "--max-num-seqs", str(args.max_num_seqs),
               "--max-model-len", str(args.max_model_len), "--no-structured-outputs",
               *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self.url = None
        for line in self.proc.stdout:
            if "listening on " in line:
                self.url = line.split("listening on ")[1].strip()
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError(f"server {' '.join(extra)} did not start")

    def metric(self, name: str) -> float:
        text = requests.get(self.url + "/metrics", timeout=30).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def send(url: str, prompt: str, max_tokens: int) -> Result:
    result = Result()
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True,
                           timeout=600) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}"
                return result
            read_stream(resp, result, start)
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        result.error = f"{type(e).__name__}: {e}"
    return result


def run_load(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[Result]:
    results: list[Result | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = send(url, prompts[i], max_tokens)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return results


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_prefix_prompts(args) -> list[str]:
    rng = random.Random(args.seed)
    systems = [f"System {s}: " + words(rng, args.system_len) for s in range(args.systems)]
    # Users arrive interleaved over the system prompts, in a shuffled order per round.
    prompts = []
    for user in range(args.users):
        order = list(range(args.systems))
        rng.shuffle(order)
        prompts += [f"{systems[s]}\nUser {user}: {words(rng, args.user_len)}" for s in order]
    return prompts


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def routing(args) -> list[dict]:
    prompts = shared_prefix_prompts(args)
    rows = []
    for mib in args.kv_cache_mib:
        for router in ("prefix", "round_robin"):
            server = Server(args, "--data-parallel-size", "2", "--router", router,
                            "--replica-cpus", "0.5", "--kv-cache-memory", str(mib << 20))
            try:
                blocks = re.search(r'^vllm:cache_config_info\{.*num_gpu_blocks="(\d+)"',
                                   requests.get(server.url + "/metrics", timeout=30).text, re.M)
                q0 = server.metric("jaxserve_prefix_cache_queries_tokens_total")
                h0 = server.metric("jaxserve_prefix_cache_hits_tokens_total")
                results = run_load(server.url, prompts, args.output_len, args.concurrency)
                time.sleep(1.5)  # the pool polls each replica's counters
                queries = server.metric("jaxserve_prefix_cache_queries_tokens_total") - q0
                hits = server.metric("jaxserve_prefix_cache_hits_tokens_total") - h0
                preempted = server.metric("jaxserve_num_preemptions_total")
            finally:
                server.stop()
            ttft = [r.ttft for r in results]
            rows.append({"mib": mib, "blocks": int(blocks.group(1)) if blocks else None,
                         "router": router, "hit_rate": hits / max(1.0, queries),
                         "preemptions": int(preempted), "ttft_p50": pct(ttft, 50),
                         "ttft_p99": pct(ttft, 99)})
            print(f"[{mib} MiB, {router}] {rows[-1]}", flush=True)
    return rows


def overhead(args) -> dict[int, dict]:
    """{concurrency: {"plain"/"ray": (TTFT p50, ITL p50) in ms, medians over the repeats}}."""
    rng = random.Random(args.seed + 1)
    prompts = [words(rng, args.overhead_prompt_len) for _ in range(args.overhead_requests)]
    runs: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for kind, extra in (("plain", ()), ("ray", ("--data-parallel-size", "1",
                                                      "--replica-cpus", "0.5"))):
            server = Server(args, *extra)
            try:
                run_load(server.url, prompts[:2], args.output_len, 1)  # first-request paths
                for c in args.overhead_concurrency:
                    results = run_load(server.url, prompts, args.output_len, c)
                    ttft = pct([r.ttft for r in results], 50)
                    itl = pct([x for r in results for x in r.itl], 50)
                    runs.setdefault((c, kind), []).append((ttft, itl))
                    print(f"[{kind}, {c} concurrent] TTFT p50 {ttft:.1f} ms, ITL p50 "
                          f"{itl:.1f} ms", flush=True)
            finally:
                server.stop()
    return {c: {kind: tuple(np.median(np.asarray(runs[(c, kind)]), axis=0))
                for kind in ("plain", "ray")} for c in args.overhead_concurrency}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--system-len", type=int, default=200, help="words per system prompt")
    p.add_argument("--user-len", type=int, default=12, help="words per user question")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-mib", type=lambda v: [int(x) for x in v.split(",")],
                   default=[72, 160], help="KV cache per replica, MiB, one routing run each "
                   "(default 72,160: about half the system prompts fit beside a full batch; "
                   "all of them fit)")
    p.add_argument("--overhead-requests", type=int, default=32)
    p.add_argument("--overhead-concurrency", type=lambda v: [int(x) for x in v.split(",")],
                   default=[1, 8], help="comma-separated concurrency levels (default 1,8)")
    p.add_argument("--overhead-prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="plain/ray alternations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--part", default="all", choices=("all", "routing", "overhead"))
    p.add_argument("--out", default=None, help="write the results as markdown here")
    args = p.parse_args()
    load = os.getloadavg()
    header = (f"CPU: {describe()}; load average before: "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(header, flush=True)
    rows = routing(args) if args.part != "overhead" else None
    lines = [
        "# Replicas on Ray Serve: routing and overhead", "",
        f"`python scripts/bench_replicas.py` on {header}. Model {args.model}; the peer of each "
        "row is the other row of its table, measured in the same run."]
    if rows is not None:
        lines += ["", f"## Shared prefixes: {args.systems} system prompts ({args.system_len} "
                  f"words) x {args.users} users, {args.concurrency} concurrent, 2 replicas", "",
                  "| KV cache per replica | router | prefix-cache hit rate | preemptions | "
                  "TTFT p50 (ms) | TTFT p99 (ms) |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['mib']} MiB ({r['blocks'] // 2} blocks) | {r['router']} | "
                         f"{r['hit_rate']:.1%} | {r['preemptions']} | {r['ttft_p50']:.0f} | "
                         f"{r['ttft_p99']:.0f} |")
        lines.append("")
        for pre, rr in zip(rows[::2], rows[1::2]):
            lines.append(f"- {pre['mib']} MiB: prefix / round_robin TTFT p50 "
                         f"x{pre['ttft_p50'] / rr['ttft_p50']:.2f}, p99 "
                         f"x{pre['ttft_p99'] / rr['ttft_p99']:.2f}.")
    if args.part != "routing":
        lines += ["", f"## Overhead of the Ray path: {args.overhead_requests} distinct prompts "
                  f"({args.overhead_prompt_len} words), {args.output_len} tokens each, median "
                  f"of {args.repeats} alternating server starts", "",
                  "| concurrent requests | server | TTFT p50 (ms) | ITL p50 (ms) | Ray / plain |",
                  "|---|---|---|---|---|"]
        for c, o in overhead(args).items():
            (t0, i0), (t1, i1) = o["plain"], o["ray"]
            lines += [f"| {c} | plain (one engine in the HTTP process) | {t0:.1f} | {i0:.1f} | |",
                      f"| {c} | Ray Serve, 1 replica | {t1:.1f} | {i1:.1f} | TTFT x{t1 / t0:.2f}, "
                      f"ITL x{i1 / i0:.2f} |"]
        lines += ["", "Goal: the Ray path within 1.10 of the plain server."]
    load = os.getloadavg()
    lines += ["", f"Load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
