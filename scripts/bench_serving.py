"""Serving benchmark against a running jaxserve (or any OpenAI-compatible) server.

Sends `--num-prompts` streaming completion requests, arriving as a Poisson process at
`--request-rate` requests/s (or all at once with `--request-rate inf`), and reports the
metrics of vLLM's serving benchmark: TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90,
p99), request and token throughput.

    jaxserve serve smollm2-135m --port 8000 &
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 32 \
        --request-rate 4 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import threading
import time

import numpy as np
import requests

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river garden music "
         "story window paper light water city mountain evening question market").split()


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    # Distinct random word sequences (about one token per word) so no two prompts are equal.
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


def read_stream(resp, result: Result, start: float) -> None:
    last = None
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"].get("message", "error in stream"))
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            result.output_tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices", [])):
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now


def send(args, prompt: str, result: Result) -> None:
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    start = time.perf_counter()
    try:
        with requests.post(args.base_url + "/v1/completions", json=body, headers=headers,
                           stream=True, timeout=args.timeout) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return
            read_stream(resp, result, start)
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        result.error = f"{type(e).__name__}: {e}"


def run(args) -> tuple[list[Result], float]:
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    rng = np.random.default_rng(args.seed)
    results = [Result() for _ in prompts]
    threads = []
    start = time.perf_counter()
    for prompt, result in zip(prompts, results):
        t = threading.Thread(target=send, args=(args, prompt, result))
        t.start()
        threads.append(t)
        if args.request_rate != float("inf"):
            time.sleep(rng.exponential(1.0 / args.request_rate))
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def _row(name: str, values_s: list[float]) -> str:
    ms = np.asarray(values_s) * 1000.0
    if ms.size == 0:
        return f"| {name} | - | - | - | - |"
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"| {name} | {ms.mean():.1f} | {p50:.1f} | {p90:.1f} | {p99:.1f} |"


def report(args, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens}
    rate = "inf (all at once)" if args.request_rate == float("inf") else \
        f"{args.request_rate}/s"
    print(f"requests: {len(ok)} ok / {len(results) - len(ok)} failed, request rate {rate}, "
          f"input ~{args.input_len} words, output {args.output_len} tokens")
    print(f"duration {duration:.2f} s; request throughput {summary['request_throughput']:.2f} "
          f"req/s; output tokens {summary['output_token_throughput']:.1f} tok/s; "
          f"total tokens {summary['total_token_throughput']:.1f} tok/s "
          f"({in_tokens} in, {out_tokens} out)")
    print("\n| metric (ms) | mean | p50 | p90 | p99 |\n|---|---|---|---|---|")
    for name, values in (("TTFT", [r.ttft for r in ok]), ("TPOT", tpot),
                         ("ITL", [x for r in ok for x in r.itl]),
                         ("E2E latency", [r.e2e for r in ok])):
        print(_row(name, values))
    for r in results:
        if not r.ok and r.error:
            print(f"error: {r.error}")
            break
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s; inf sends all at once")
    p.add_argument("--input-len", type=int, default=64, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens (EOS ignored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args()
    results, duration = run(args)
    summary = report(args, results, duration)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
