"""Soak test: steady Poisson load on a loopback server for M minutes, watching for leaks.

    .venv/bin/python scripts/soak.py --minutes 30 --rate 2 --out-dir docs/results/soak_30min

Starts a server in a child process (scripts/loopback_server.py; the tiny random model unless
`--model`), sends streaming completions arriving as a Poisson process at `--rate` requests/s
(mixed prompt lengths, max_tokens, n, temperature and seeds), and every `--sample-s` seconds
records the server's RSS, KV blocks in use, running and waiting counts (/v1/engine/state) and
the p50/p99 end-to-end latency of the requests that finished in that interval. Writes
soak.csv and soak.png to `--out-dir` and exits non-zero when:

* any request got a 5xx, an error event or no [DONE];
* the server does not come back to 0 blocks in use, 0 running and 0 waiting after the load;
* RSS or KV blocks in use trend upward: the least-squares slope over the samples after the
  first `--warmup-frac` of the run, extrapolated over that window, exceeds the tolerance
  (`--rss-tol-mib`, `--blocks-tol-frac` of the pool; see `trend_violations` for why these).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import dataclasses
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from load_client import random_prompt, stream_completion
from loopback_server import ServerSpec, engine_gauges, start, wait_idle

COLUMNS = ("t_s", "rss_mib", "kv_blocks_in_use", "running", "waiting", "client_in_flight",
           "completed", "failed", "p50_s", "p99_s")


@dataclasses.dataclass
class Tally:
    """Requests finished since the last sample (latencies) and in total; guarded by `lock`."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    latencies: list[float] = dataclasses.field(default_factory=list)
    in_flight: int = 0
    completed: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    def finish(self, outcome) -> None:
        ok = outcome.status == 200 and outcome.done and not outcome.error
        with self.lock:
            self.in_flight -= 1
            if ok:
                self.completed += 1
                self.latencies.append(outcome.latency_s)
            else:
                self.failures.append(f"status {outcome.status}: {outcome.error or 'no [DONE]'}")

    def take_latencies(self) -> list[float]:
        with self.lock:
            lat, self.latencies = self.latencies, []
            return lat


def request_body(rng: random.Random, model: str, max_new: int) -> dict:
    body = {"model": model, "prompt": random_prompt(rng, 2, 40),
            "max_tokens": rng.randint(4, max_new), "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    if rng.random() < 0.15:
        body["n"] = 2
    return body


def load(url: str, model: str, args, tally: Tally, stop: threading.Event) -> None:
    """Poisson arrivals at args.rate until `stop`; each request runs on a pool thread."""
    rng = random.Random(args.seed)
    pool = cf.ThreadPoolExecutor(max_workers=args.max_concurrency)
    next_t = time.monotonic()
    while not stop.is_set():
        next_t += rng.expovariate(args.rate)
        stop.wait(max(0.0, next_t - time.monotonic()))
        if stop.is_set():
            break
        body = request_body(rng, model, args.max_tokens)
        with tally.lock:
            tally.in_flight += 1
        pool.submit(lambda b=body: tally.finish(stream_completion(url, b)))
    pool.shutdown(wait=True)


def sample(url: str, pid: int, t0: float, tally: Tally) -> dict:
    g = engine_gauges(url)
    lat = np.asarray(tally.take_latencies())
    with tally.lock:
        in_flight, completed, failed = tally.in_flight, tally.completed, len(tally.failures)
    return {"t_s": round(time.monotonic() - t0, 2),
            "rss_mib": round(psutil.Process(pid).memory_info().rss / 2**20, 2),
            "kv_blocks_in_use": g["kv_blocks_in_use"], "running": g["running"],
            "waiting": g["waiting"], "client_in_flight": in_flight, "completed": completed,
            "failed": failed,
            "p50_s": round(float(np.percentile(lat, 50)), 4) if lat.size else "",
            "p99_s": round(float(np.percentile(lat, 99)), 4) if lat.size else ""}


def slope_growth(t: np.ndarray, y: np.ndarray) -> float:
    """Growth over the window predicted by the least-squares line through (t, y)."""
    if t.size < 3 or np.ptp(t) == 0:
        return 0.0
    return float(np.polyfit(t, y, 1)[0] * np.ptp(t))


def trend_violations(rows: list[dict], args, total_blocks: int) -> tuple[list[str], dict]:
    """Upward trends in RSS and blocks in use after the warm-up part of the run.

    RSS tolerance: an absolute `--rss-tol-mib` (default 32 MiB) over the window, since the
    first minutes grow while XLA, the allocator's arenas and Python's caches settle (that part
    is cut by --warmup-frac) and the rest wanders by a few MiB; a leak of 10 KB per request at
    2 req/s is 35 MiB in 30 minutes, which it catches. Blocks: the pool's in-use count
    follows the load, so the trend line of a steady load is flat; a leaked block never comes
    back, so `--blocks-tol-frac` (default 5%) of the pool over the window flags a leak of a
    few blocks per minute, while the final drain check catches any leak at all.
    """
    t = np.asarray([r["t_s"] for r in rows], float)
    keep = t >= t.max() * args.warmup_frac if t.size else t
    rss = slope_growth(t[keep], np.asarray([r["rss_mib"] for r in rows], float)[keep])
    blocks = slope_growth(t[keep],
                          np.asarray([r["kv_blocks_in_use"] for r in rows], float)[keep])
    fits = {"rss_growth_mib": round(rss, 2), "blocks_growth": round(blocks, 2),
            "rss_tol_mib": args.rss_tol_mib, "blocks_tol": args.blocks_tol_frac * total_blocks}
    bad = []
    if rss > args.rss_tol_mib:
        bad.append(f"RSS trends upward: +{rss:.1f} MiB over the window (tolerance "
                   f"{args.rss_tol_mib} MiB)")
    if blocks > fits["blocks_tol"]:
        bad.append(f"KV blocks in use trend upward: +{blocks:.1f} over the window (tolerance "
                   f"{fits['blocks_tol']:.1f})")
    return bad, fits


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = np.asarray([r["t_s"] for r in rows], float) / 60
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    panels = [("RSS (MiB)", ["rss_mib"]), ("KV blocks in use", ["kv_blocks_in_use"]),
              ("requests", ["running", "waiting", "client_in_flight"]),
              ("latency (s)", ["p50_s", "p99_s"])]
    for ax, (label, cols) in zip(axes, panels):
        for col in cols:
            y = np.asarray([r[col] if r[col] != "" else np.nan for r in rows], float)
            ax.plot(t, y, label=col, lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(cols) > 1:
            ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def run(args) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(model=args.model, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len)
    with start(spec) as server:
        model = served_model(server.url)
        total = engine_gauges(server.url)["kv_blocks_total"]
        rows, tally, stop = [], Tally(), threading.Event()
        t0 = time.monotonic()
        loader = threading.Thread(target=load, args=(server.url, model, args, tally, stop))
        loader.start()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            rows.append(sample(server.url, server.pid, t0, tally))
            if args.verbose:
                print(rows[-1], flush=True)
        stop.set()
        loader.join()
        idle = wait_idle(server.url)
        rows.append(sample(server.url, server.pid, t0, tally))
    return report(rows, tally, idle, total, server.exit_code, args, out_dir)


def served_model(url: str) -> str:
    import requests
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def report(rows, tally, idle, total, exit_code, args, out_dir: Path) -> int:
    write_csv(rows, out_dir / "soak.csv")
    bad, fits = trend_violations(rows[:-1], args, total)
    if tally.failures:
        bad.append(f"{len(tally.failures)} requests failed, e.g. {tally.failures[:3]}")
    if idle["kv_blocks_in_use"] or idle["running"] or idle["waiting"]:
        bad.append(f"not idle after the load: {idle}")
    if exit_code != 0:
        bad.append(f"the server exited with {exit_code} after SIGTERM (want 0)")
    lat = [r["p99_s"] for r in rows if r["p99_s"] != ""]
    title = (f"soak: {args.model} model, {args.rate} req/s Poisson, {args.minutes} min, "
             f"{tally.completed} requests\nRSS +{fits['rss_growth_mib']} MiB, blocks "
             f"{fits['blocks_growth']:+} (trend over the window after warm-up)")
    plot(rows, out_dir / "soak.png", title)
    print(f"soak: {args.minutes} min, {tally.completed} requests completed, "
          f"{len(tally.failures)} failed, RSS {rows[0]['rss_mib']} -> {rows[-1]['rss_mib']} MiB, "
          f"trend {fits}, max p99 {max(lat) if lat else '-'} s, load {os.getloadavg()}")
    for line in bad:
        print("VIOLATION:", line)
    print("soak:", "FAIL" if bad else "OK", f"(csv and plot in {out_dir})")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--model", default="tiny", help="'tiny' (random) or a model name/path")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=128,
                    help="client threads; arrivals beyond them queue on the client")
    ap.add_argument("--warmup-frac", type=float, default=0.2,
                    help="leading fraction of the run left out of the trend fits")
    ap.add_argument("--rss-tol-mib", type=float, default=32.0)
    ap.add_argument("--blocks-tol-frac", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="soak_out")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.sample_s <= 0:
        ap.error("--minutes, --rate and --sample-s must be positive")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
