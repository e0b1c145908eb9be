"""Stress test: N concurrent streaming clients against a loopback server, half dropped mid-stream.

    .venv/bin/python scripts/stress_server.py                 # 200 clients, tiny random model
    .venv/bin/python scripts/stress_server.py --clients 50 --model smollm2-135m

Starts a server in a child process (scripts/loopback_server.py), then opens `--clients`
streaming completions at once with mixed n, stop strings, logprobs, greedy or seeded sampling;
a random half hang up after 1-3 chunks. Afterwards it checks, and exits non-zero on any
violation:

* the engine is idle: 0 KV blocks in use, 0 running, 0 waiting (/v1/engine/state);
* every survivor finished (data: [DONE]) and its text equals that of the same request run
  alone afterwards (greedy or seeded, so the solo run is the reference);
* no 5xx (and no other non-200) for any client.

Prints a JSON summary (`--json PATH` also writes it). Bounded: `--timeout` seconds overall.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from load_client import WORDS, random_prompt, stream_completion
from loopback_server import ServerSpec, start, wait_idle


def make_body(rng: random.Random, model: str, max_tokens: int) -> dict:
    """A request whose output is reproducible: greedy, or sampled with a seed."""
    body = {"model": model, "prompt": random_prompt(rng, 2, 30),
            "max_tokens": rng.randint(4, max_tokens)}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 30))
    if rng.random() < 0.25:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    return body


def storm(url: str, bodies: list[dict], drops: list[int | None]) -> list:
    """All clients at once: each thread waits on one barrier, then streams."""
    barrier = threading.Barrier(len(bodies))

    def client(i):
        barrier.wait()
        return stream_completion(url, bodies[i], drop_after=drops[i])

    with cf.ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(client, range(len(bodies))))


def check(outcomes, bodies, drops, solo, idle) -> list[str]:
    bad = []
    statuses = collections.Counter(o.status for o in outcomes)
    if set(statuses) != {200}:
        bad.append(f"non-200 responses: {dict(statuses)}, e.g. "
                   f"{[o.error for o in outcomes if o.status != 200][:2]}")
    for i, o in enumerate(outcomes):
        if drops[i] is not None or o.status != 200:
            continue
        if not o.done or o.error:
            bad.append(f"client {i}: no [DONE] or an error event: {o.error!r}")
        elif o.texts != solo[i].texts:
            bad.append(f"client {i}: text differs from its solo run: {o.texts} vs "
                       f"{solo[i].texts} (body {bodies[i]})")
    if idle["kv_blocks_in_use"] or idle["running"] or idle["waiting"]:
        bad.append(f"engine not idle afterwards: {idle}")
    return bad


def run(args, holder: dict) -> dict:
    rng = random.Random(args.seed)
    spec = ServerSpec(model=args.model, max_num_seqs=args.max_num_seqs,
                      threads=max(64, 2 * args.clients),
                      max_waiting_requests=4 * args.clients)
    with start(spec) as server:
        holder["proc"] = server.proc  # for main() to kill at the overall timeout
        import requests
        model = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        bodies = [make_body(rng, model, args.max_tokens) for _ in range(args.clients)]
        drops = [rng.randint(1, 3) if rng.random() < 0.5 else None for _ in bodies]
        t0 = time.monotonic()
        outcomes = storm(server.url, bodies, drops)
        storm_s = time.monotonic() - t0
        idle = wait_idle(server.url)
        survivors = [i for i, d in enumerate(drops) if d is None]
        solo = {i: stream_completion(server.url, bodies[i]) for i in survivors}
        bad = check(outcomes, bodies, drops, solo, idle)
    summary = {"clients": args.clients, "dropped": args.clients - len(survivors),
               "survivors": len(survivors),
               "survivors_matching_solo": sum(outcomes[i].texts == solo[i].texts
                                              for i in survivors),
               "statuses": dict(collections.Counter(o.status for o in outcomes)),
               "storm_s": round(storm_s, 2), "engine_after": idle,
               "server_exit_code": server.exit_code, "violations": bad,
               "model": args.model, "load_avg": [round(x, 2) for x in os.getloadavg()]}
    if server.exit_code != 0:
        bad.append(f"the server exited with {server.exit_code} after SIGTERM (want 0)")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--model", default="tiny", help="'tiny' (random) or a model name/path")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    if not 1 <= args.clients <= 1000:
        ap.error("--clients must be in [1, 1000]")
    result, holder = {}, {}
    worker = threading.Thread(target=lambda: result.update(run(args, holder)), daemon=True)
    worker.start()
    worker.join(args.timeout)
    if worker.is_alive():
        print(f"stress: FAIL, not done within {args.timeout:.0f} s", flush=True)
        if "proc" in holder:
            holder["proc"].kill()
        os._exit(2)  # client threads may still block on sockets: do not wait for them
    if not result:
        print("stress: FAIL, the run raised (see above)")
        return 2
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for line in result["violations"]:
        print("VIOLATION:", line)
    print("stress:", "FAIL" if result["violations"] else "OK")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
