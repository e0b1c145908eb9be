"""Serving benchmark with a third-party client: GuideLLM against `jaxserve serve` and llama.cpp's
own `llama-server`, on the same GGUF file, in the same run.

Both servers start once and stay up; each load point (a fixed concurrency, or a fixed request
rate) runs GuideLLM against one server and then the other, the order alternating from point to
point, so a drift in this machine's speed falls on both sides alike. Before each run both servers
must be idle (under 5% of a core for a second): a server still finishing the work of the run
before would slow the other one, as they share the cores. GuideLLM sends streaming
`/v1/completions` requests of synthetic text with exactly `--prompt-tokens` prompt tokens (counted
with the model's own tokenizer) and `max_tokens` = `--output-tokens` with `ignore_eos`, and
measures TTFT, inter-token latency, end-to-end latency and output throughput; its first and last
`--transient` fraction of each point (warm-up, cool-down) is left out of the figures.

Rates are GuideLLM's `constant` profile (evenly spaced arrivals), not `poisson`: in GuideLLM 0.8.1
the Poisson strategy's shared arrival clock is set after its start event fires, and a worker that
reads it first schedules every request at time ~0 (on this machine a 60 s point at 0.5/s sent
491 requests at its start). The script checks each rate point's sent rate against the asked one
and stops if they differ by more than 25%.

Peers: llama-server built natively from the llama-cpp-python sdist's vendored llama.cpp
(`bash scripts/build_llama_server.sh`, part of `scripts/setup.sh --peers`), `--parallel` slots
with continuous batching; GuideLLM in `.venv-bench` (`scripts/setup.sh --test`). Run it alone on
a quiet machine (both servers and the client share its cores):

    .venv/bin/python scripts/bench_serving_peers.py \
        --json docs/results/bench_serving_peers.json --md docs/results/bench_serving_peers.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
SERVED_NAME = "smollm2-135m"
# (figure key, GuideLLM metric, scale to the unit the report uses)
LATENCIES = (("ttft_ms", "time_to_first_token_ms", 1.0),
             ("itl_ms", "inter_token_latency_ms", 1.0),
             ("e2e_s", "request_latency", 1.0))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SERVED_NAME, help="a model name jaxserve knows or a .gguf")
    ap.add_argument("--llama-server", default=str(REPO / ".peers/llama-server/bin/llama-server"),
                    help="llama.cpp's server binary ('none': jaxserve only)")
    ap.add_argument("--guidellm", default=str(REPO / ".venv-bench/bin/guidellm"))
    ap.add_argument("--prompt-tokens", type=int, help="default 256 (32 with --quick)")
    ap.add_argument("--output-tokens", type=int, help="default 128 (8 with --quick)")
    ap.add_argument("--concurrency", help="comma-separated stream counts (default 1,8,64; 1,4 "
                    "with --quick)")
    ap.add_argument("--rates",
                    help="comma-separated fixed request rates (requests/s); the defaults "
                         "0.25,0.5,0.75 are below, at and past llama-server's capacity at the "
                         "default shape on 2 CPUs (~0.5 requests/s; jaxserve's is ~1); 1 with "
                         "--quick")
    ap.add_argument("--seconds", type=float, help="length of each load point (default 60; 10 "
                    "with --quick)")
    ap.add_argument("--long-seconds", type=float, default=150.0,
                    help="length of a concurrency point of 32 streams or more: a wave of "
                         "requests there can take a minute, and the window must hold more than "
                         "one")
    ap.add_argument("--transient", type=float, default=0.1,
                    help="fraction of each point's start and end left out (warm-up, cool-down)")
    ap.add_argument("--parallel", type=int, default=64,
                    help="sequences each server runs at once (jaxserve --max-num-seqs, "
                         "llama-server --parallel)")
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="context per sequence on both servers")
    ap.add_argument("--kv-cache-dtype", default="bfloat16",
                    help="jaxserve's KV cache (default bfloat16: llama-server keeps its cache in "
                         "f16, while jaxserve's own default on CPU is the model's float32)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server's threads (jaxserve's XLA pool takes every CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 32-token prompts, 8 tokens out, concurrency 1,4, rate 1, "
                         "10 s per point")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the report here")
    args = ap.parse_args(argv)
    # --quick changes the defaults only: what the command line names is kept
    for name, full, quick in (("prompt_tokens", 256, 32), ("output_tokens", 128, 8),
                              ("concurrency", "1,8,64", "1,4"), ("rates", "0.25,0.5,0.75", "1"),
                              ("seconds", 60.0, 10.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    args.rates = [float(r) for r in str(args.rates).split(",") if r]
    if not 0 <= args.transient < 0.5:
        ap.error("--transient must be in [0, 0.5)")
    if max(args.concurrency, default=0) > args.parallel:
        ap.error(f"--concurrency {max(args.concurrency)} exceeds --parallel {args.parallel}: "
                 "the extra streams would only queue")
    return args


# ---- GuideLLM --------------------------------------------------------------------------------

def scenario(target: str, tokenizer_dir: str, profile: dict, args, seed: int,
             model: str = SERVED_NAME) -> dict:
    """One GuideLLM run (scenario file format): one load point against one server. Each point
    gets its own `seed` (so its own prompts: no prefix cache serves one point from another's),
    both servers the same one."""
    transient = args.transient
    return {
        "metadata": {"name": "jaxserve-bench", "description": "one load point"},
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": model,
                        "request_format": "/v1/completions"},
            "profile": dict(profile, warmup=transient, cooldown=transient),
            "tokenizer": {"kind": "hf_auto", "model": tokenizer_dir},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                      "output_tokens": args.output_tokens}],
            "seed": {"kind": "static", "value": seed},
            "constraints": [{"kind": "max_duration", "seconds": seconds(args, profile)}],
            "outputs": [{"kind": "json", "path": "report.json"}],  # run_guidellm sets it
        },
    }


def run_guidellm(guidellm: str, spec: dict, timeout_s: float) -> dict:
    """Runs GuideLLM on `spec` offline; returns its one benchmark's JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = json.loads(json.dumps(spec))
        out = pathlib.Path(tmp) / "report.json"
        spec["spec"]["outputs"][0]["path"] = str(out)
        path = pathlib.Path(tmp) / "scenario.json"
        path.write_text(json.dumps(spec))
        # one worker process per CPU (unless the caller's environment says otherwise), not
        # GuideLLM's 10: the client shares the cores with the servers, and asyncio in each
        # worker holds 64 streams easily
        env = {"GUIDELLM__MAX_WORKER_PROCESSES": str(len(os.sched_getaffinity(0))),
               **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.run([guidellm, "run", "-c", str(path), "--disable-progress"],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                               f"\n{proc.stderr[-3000:]}")
        report = json.loads(out.read_text())
    if len(report["benchmarks"]) != 1:
        raise RuntimeError(f"expected one benchmark, got {len(report['benchmarks'])}")
    return report["benchmarks"][0]


def figures(benchmark: dict) -> dict:
    """The report's figures from one GuideLLM benchmark. Output tok/s is GuideLLM's server
    throughput: every token streamed within the measured window, requests cut by its end
    included (at 64 streams a request can outlast the window); the latencies and token counts
    are over completed requests, as in GuideLLM's own tables."""
    m = benchmark["metrics"]
    out = {"completed": m["request_totals"]["successful"],
           "errored": m["request_totals"]["errored"],
           "incomplete": m["request_totals"]["incomplete"],
           "duration_s": benchmark["duration"],
           # every request started in the window, finished or not: the load actually offered
           "sent_req_s": m["request_totals"]["total"] / benchmark["duration"],
           "output_tok_s": m["output_tokens_per_second"]["total"]["mean"],
           "requests_s": m["requests_per_second"]["successful"]["mean"],
           "output_tokens_per_request": m["output_token_count"]["successful"]["mean"],
           "prompt_tokens_per_request": m["prompt_token_count"]["successful"]["mean"]}
    for key, metric, scale in LATENCIES:
        pct = m[metric]["successful"]["percentiles"]
        out[key] = {"p50": pct["p50"] * scale, "p99": pct["p99"] * scale}
    return out


def prefix_hit_tokens(url: str) -> float:
    """jaxserve's prefix-cache hits so far (tokens), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text)
               if fam.name.startswith("jaxserve_prefix_cache_hits_tokens")
               for s in fam.samples if s.name.endswith("_total"))


def guidellm_version(guidellm: str) -> str:
    proc = subprocess.run([guidellm, "--version"], capture_output=True, text=True, timeout=120)
    return proc.stdout.strip().split()[-1] if proc.returncode == 0 else "?"


# ---- servers ---------------------------------------------------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxserve_cmd(args, gguf: str, port: int) -> list[str]:
    return [str(REPO / ".venv/bin/jaxserve"), "serve", gguf, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-num-seqs", str(args.parallel), "--max-model-len", str(args.max_model_len),
            "--kv-cache-dtype", args.kv_cache_dtype]


def llama_server_cmd(args, gguf: str, port: int) -> list[str]:
    # -c is the whole cache, shared out as --parallel slots of max_model_len each.
    return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--alias", SERVED_NAME, "--parallel", str(args.parallel),
            "-c", str(args.parallel * args.max_model_len), "--threads", str(args.threads),
            "--threads-batch", str(args.threads), "--cont-batching", "--no-webui"]


@contextlib.contextmanager
def server(name: str, cmd: list[str], port: int, log_dir: str, timeout_s: float = 1200):
    """Starts `cmd`, waits until GET /health answers 200; yields (url, start-up seconds, pid)."""
    log = open(pathlib.Path(log_dir) / f"{name}.log", "w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); log: {log.name}")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{name} not ready after {timeout_s:.0f}s; log: {log.name}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            time.sleep(2)
        yield url, time.perf_counter() - start, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def cpu_seconds(pid: int) -> float:
    """CPU time `pid` has used (user + system), from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(pids: list[int], busy: float = 0.05, timeout_s: float = 300) -> float:
    """Waits until every process in `pids` used under `busy` of a core over one second; returns
    the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        before = [cpu_seconds(p) for p in pids]
        time.sleep(1.0)
        if all(cpu_seconds(p) - b < busy for p, b in zip(pids, before)):
            return time.perf_counter() - start
    raise RuntimeError(f"servers still busy after {timeout_s:.0f} s")


def check_rate(label: str, profile: dict, f: dict, tolerance: float = 0.25) -> None:
    """A rate point must offer the rate it names (see the module doc on GuideLLM's Poisson)."""
    if profile["kind"] != "constant":
        return
    asked = profile["rate"][0]
    if abs(f["sent_req_s"] - asked) > tolerance * asked:
        raise RuntimeError(f"{label}: GuideLLM sent {f['sent_req_s']:.2f} requests/s, asked "
                           f"{asked:g}/s: the figures would not be of the load they name")


# ---- the run ---------------------------------------------------------------------------------

def points(args) -> list[tuple[str, dict]]:
    """(label, GuideLLM profile) of every load point, in the order they run."""
    return ([(f"concurrency {c}", {"kind": "concurrent", "streams": [c]})
             for c in args.concurrency] +
            [(f"rate {r:g}/s", {"kind": "constant", "rate": [r]}) for r in args.rates])


def seconds(args, profile: dict) -> float:
    """How long a load point runs."""
    long = profile["kind"] == "concurrent" and max(profile["streams"]) >= 32
    return args.long_seconds if long else args.seconds


def environment(args, gguf: str) -> dict:
    from jaxserve.tools.machine import describe
    versions = {"guidellm": guidellm_version(args.guidellm)}
    if args.llama_server != "none":
        proc = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True,
                              timeout=60)
        versions["llama-server"] = (proc.stdout + proc.stderr).strip().splitlines()[0]
        llama_ver = REPO / ".peers/llama-server/.version"
        if llama_ver.exists():
            versions["llama-server"] += f" (llama-cpp-python {llama_ver.read_text().strip()} sdist)"
    return {"machine": describe(), "cpus": len(os.sched_getaffinity(0)),
            "load_avg_start": os.getloadavg(), "gguf": os.path.basename(gguf),
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "seconds_per_point": args.seconds, "long_seconds": args.long_seconds,
            "transient": args.transient,
            "parallel": args.parallel, "max_model_len": args.max_model_len,
            "kv_cache_dtype": args.kv_cache_dtype,
            "llama_server_threads": args.threads, "versions": versions}


def run(args, gguf: str, tokenizer_dir: str, log_dir: str) -> dict:
    systems = {"jaxserve": jaxserve_cmd}
    if args.llama_server != "none":
        systems["llama-server"] = llama_server_cmd
    results: dict = {"startup_s": {}, "commands": {}, "points": []}
    with contextlib.ExitStack() as stack:
        urls, pids = {}, []
        for name, make in systems.items():  # one at a time: start-up is timed alone
            port = free_port()
            cmd = make(args, gguf, port)
            results["commands"][name] = " ".join(shlex.quote(c) for c in cmd)
            urls[name], results["startup_s"][name], pid = stack.enter_context(
                server(name, cmd, port, log_dir))
            pids.append(pid)
            print(f"{name}: ready in {results['startup_s'][name]:.1f}s", flush=True)
        for i, (label, profile) in enumerate(points(args)):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            point = {"label": label, "profile": profile, "order": order, "systems": {}}
            for name in order:
                waited = wait_until_idle(pids)
                load = os.getloadavg()[0]
                hits = prefix_hit_tokens(urls[name]) if name == "jaxserve" else None
                bench = run_guidellm(args.guidellm, scenario(urls[name], tokenizer_dir, profile,
                                                             args, seed=args.seed + 1000 * i),
                                     timeout_s=seconds(args, profile) * 3 + 600)
                point["systems"][name] = dict(figures(bench), load_avg_1m_before=load,
                                              idle_wait_s=waited)
                check_rate(label, profile, point["systems"][name])
                if hits is not None:
                    point["systems"][name]["prefix_hit_tokens"] = (
                        prefix_hit_tokens(urls[name]) - hits)
                print(f"{label:>16} {name:>12}: {line(point['systems'][name])}", flush=True)
            results["points"].append(point)
    return results


def line(f: dict) -> str:
    return (f"{f['output_tok_s']:7.1f} tok/s  TTFT p50 {f['ttft_ms']['p50']:7.0f} ms  "
            f"ITL p50 {f['itl_ms']['p50']:5.1f} ms  e2e p50 {f['e2e_s']['p50']:5.2f} s  "
            f"({f['completed']} done, {f['errored']} errors)")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render_markdown(env: dict, results: dict, command: str) -> str:
    names = list(results["startup_s"])
    lines = ["# Serving benchmark: jaxserve vs llama.cpp's llama-server, GuideLLM as the client",
             "", f"Command: `{command}`", "",
             f"Machine: {env['machine']}; load average at start "
             f"{', '.join(f'{x:.2f}' for x in env['load_avg_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in env['load_avg_end'])}.",
             f"Versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}.",
             f"Workload: GuideLLM synthetic text, {env['prompt_tokens']} prompt tokens -> "
             f"{env['output_tokens']} output tokens (`ignore_eos`), streaming `/v1/completions`, "
             f"{env['seconds_per_point']:g} s per load point ({env['long_seconds']:g} s at 32 "
             f"streams or more), its own prompts at each point, first and last "
             f"{env['transient']:.0%} left out; both servers on `{env['gguf']}`, "
             f"{env['parallel']} sequences at once, {env['max_model_len']} tokens each; KV cache "
             f"{env['kv_cache_dtype']} in jaxserve, f16 (its default) in "
             "llama-server.", ""]
    lines += ["| load | system | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
              "e2e p50 / p99 s | sent req/s | done (errors) | load avg before |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def pair(f: dict, key: str, fmt: str) -> str:
        # no completed request: no latency to report (a 0 would read as instant)
        if not f["completed"]:
            return "-"
        return f"{f[key]['p50']:{fmt}} / {f[key]['p99']:{fmt}}"

    for p in results["points"]:
        for name in names:
            f = p["systems"][name]
            lines.append(
                f"| {p['label']} | {name} | {f['output_tok_s']:.1f} | "
                f"{pair(f, 'ttft_ms', '.0f')} | {pair(f, 'itl_ms', '.1f')} | "
                f"{pair(f, 'e2e_s', '.2f')} | "
                f"{f['sent_req_s']:.2f} | {f['completed']} ({f['errored']}) | "
                f"{f['load_avg_1m_before']:.2f} |")
    if len(names) == 2:
        a, b = names
        lines += ["", f"Ratios, {a} / {b} (throughput: higher is better for {a}; "
                  f"latencies: lower is better for {a}):", "",
                  "| load | output tok/s | TTFT p50 | ITL p50 | e2e p50 |",
                  "|---|---:|---:|---:|---:|"]
        for p in results["points"]:
            fa, fb = p["systems"][a], p["systems"][b]

            def lat(key: str) -> str:
                if not (fa["completed"] and fb["completed"]):
                    return "-"
                return ratio(fa[key]["p50"], fb[key]["p50"])

            lines.append(f"| {p['label']} | {ratio(fa['output_tok_s'], fb['output_tok_s'])} | "
                         f"{lat('ttft_ms')} | {lat('itl_ms')} | {lat('e2e_s')} |")
    hits = [f"{p['label']} {p['systems']['jaxserve'].get('prefix_hit_tokens', 0):.0f}"
            for p in results["points"] if "jaxserve" in p["systems"]]
    lines += ["", "Each run starts with both servers idle (under 5% of a core for a second); the "
              "load average before it is the last minute's, mostly the run before: the servers "
              "and the client share the cores. Sent req/s counts every request started in the "
              "window, finished or not. A '-' latency: no request finished in the window (the "
              "server was past its capacity). Tokens jaxserve's prefix cache served, per point "
              "(each point's prompts are new to both servers): " + ", ".join(hits) + "."]
    lines += ["", "Start-up (process start to /health 200, jaxserve's warm-up compile included): "
              + ", ".join(f"{n} {s:.1f} s" for n, s in results["startup_s"].items()) + ".", "",
              "Server commands:", ""]
    lines += [f"- {n}: `{c}`" for n, c in results["commands"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from models.registry import model_path
    from models.tokenizer import Tokenizer
    gguf = str(model_path(args.model)) if not args.model.endswith(".gguf") else args.model
    if args.llama_server != "none" and not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: build it with "
                 "`bash scripts/build_llama_server.sh` (or pass --llama-server none)")
    if not os.access(args.guidellm, os.X_OK):
        sys.exit(f"no GuideLLM at {args.guidellm}: `bash scripts/setup.sh --test` installs it")
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    env = environment(args, gguf)
    print("command:", command)
    print("environment:", json.dumps(env), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # GuideLLM counts prompt tokens with the model's own tokenizer, from the GGUF file.
        tokenizer_dir = os.path.join(tmp, "tokenizer")
        Tokenizer.from_gguf(gguf).save(tokenizer_dir)
        log_dir = tempfile.mkdtemp(prefix="bench_serving_peers_")
        print("server logs:", log_dir, flush=True)
        results = run(args, gguf, tokenizer_dir, log_dir)
    env["load_avg_end"] = os.getloadavg()
    report = render_markdown(env, results, command)
    print(report)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"environment": env, **results}, indent=1))
    if args.md:
        pathlib.Path(args.md).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
