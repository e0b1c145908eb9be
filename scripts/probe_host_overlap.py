"""Can host work hide behind the device step on this machine? (docs/performance.md, "The engine loop")

Tiny random model, N sequences in steady decode (bench_host_overhead.py's set-up). Modes:
  util     the bare device loop's cores busy: process CPU time / wall while the captured step
           calls are replayed back to back
  overlap  one step with X ms of pure-Python work between its dispatch and the wait for the
           previous one, against the bare step time (ideal: max(bare, X))
  prof     cProfile of N engine steps, by cumulative time
  --pin    (util, overlap) XLA's threads on one core and this thread on another: a device that
           does not share the host's cores (a diagnostic; Linux, >= 2 CPUs; --host-cores does
           it properly, a pool sized for the CPUs it has)
  hostonly the host's own work per engine step: main-thread CPU time of engine steps whose
           device call is replaced by the last real step's output (no device work, no dispatch,
           no core shared with XLA's threads), median of --repeats windows of 100 steps; also
           in units of a fixed Python loop timed around each window (reference_ms), which
           compares runs taken while the VM ran at different speeds

    .venv/bin/python scripts/probe_host_overlap.py overlap --seqs 64
    .venv/bin/python scripts/probe_host_overlap.py hostonly --seqs 64 --output-kind DELTA
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import pstats
import statistics
import time


def engine_in_steady_decode(n: int, steps: int, output_kind: str = "CUMULATIVE"):
    import numpy as np
    import bench_host_overhead as b
    from jaxserve import RequestOutputKind, SamplingParams
    from models.model import enable_compilation_cache
    from models.random_init import random_model
    enable_compilation_cache()
    args = b.parse_args(["--batch-sizes", str(n), "--steps", str(steps * 6)])
    settle_limit, max_tokens, max_len = b.lengths(n, args)
    model = random_model(b.model_config("tiny", max_len), "float32", 0)
    engine = b.make_engine(model, n, max_len, "on")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0,
                            output_kind=RequestOutputKind[output_kind])
    for i in range(n):
        engine.add_request(f"r{i}", rng.integers(1, 256, 8).tolist(), params)
    b.settle(engine, n, 10, settle_limit)
    return engine


def captured_calls(engine, steps: int) -> list:
    calls, runner = [], engine.runner
    runner.before_call = calls.append
    for _ in range(steps):
        engine.step()
    runner.before_call = None
    return calls


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def replay(runner, calls) -> tuple[float, float]:
    """(wall, process CPU) seconds per call, back to back."""
    import jax
    jax.block_until_ready(runner.run(calls[0]))
    w0, c0 = time.perf_counter(), time.process_time()
    for c in calls:
        out = runner.run(c)
    jax.block_until_ready(out)
    return (time.perf_counter() - w0) / len(calls), (time.process_time() - c0) / len(calls)


def overlapped(runner, calls, x_ms: float) -> float:
    import jax
    prev = runner.run(calls[0])
    jax.block_until_ready(prev)
    w0 = time.perf_counter()
    for c in calls:
        out = runner.run(c)
        busy(x_ms)
        jax.block_until_ready(prev)
        prev = out
    jax.block_until_ready(prev)
    return (time.perf_counter() - w0) / len(calls)


def pin_device_threads() -> None:
    """This thread on CPU 0, every other thread of the process (XLA's pools, started by now)
    on CPU 1."""
    import threading
    me = threading.get_native_id()
    for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
        tid = int(task.name)
        os.sched_setaffinity(tid, {0} if tid == me else {1})


def host_only(engine, repeats: int, steps: int = 100) -> str:
    """Main-thread CPU per engine step with the step's device call answered by the last real
    output: the scheduler, row preparation, sampling results and outputs, nothing else."""
    import jax
    from jaxserve.runtime.step_call import StepCall
    runner, last = engine.runner, {}
    real = runner.run

    def answered(call):
        if not isinstance(call, StepCall):
            return real(call)
        if "out" not in last:
            last["out"] = jax.block_until_ready(real(call))
        return last["out"]

    runner.run = answered
    for _ in range(20):  # the last real step in flight is collected; caches warm
        engine.step()
    times, ratios = [], []
    reference_ms()  # its first run is slower (allocator, caches)
    for _ in range(repeats):
        ref = reference_ms()
        t = time.thread_time()
        for _ in range(steps):
            engine.step()
        times.append(1e3 * (time.thread_time() - t) / steps)
        ratios.append(times[-1] / statistics.mean((ref, reference_ms())))
    return (f"median {statistics.median(times):.3f}, min {min(times):.3f} "
            f"({', '.join(f'{x:.3f}' for x in times)}); in reference loops: median "
            f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")


def reference_ms() -> float:
    """Main-thread CPU ms of a fixed pure-Python loop (attribute reads, calls, small tuples,
    dict and list work, as the host path does): the machine's speed of the moment. This VM's
    speed drifts by up to 2x over minutes; host time divided by it compares runs taken in
    different phases."""
    class Item:
        def __init__(self, i):
            self.i, self.out = i, [i]

    def touch(item, table):
        item.out.append(item.i)
        table[item.i] = (item.i, len(item.out))

    t = time.thread_time()
    for _ in range(5):
        items, table = [Item(i) for i in range(2000)], {}
        for item in items:
            touch(item, table)
        sum(v[1] for v in table.values())
    return 1e3 * (time.thread_time() - t)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("util", "overlap", "prof", "hostonly"))
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pin", action="store_true",
                    help="pin XLA's threads to CPU 1 and this thread to CPU 0 after start-up")
    ap.add_argument("--busy-ms", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5, 2.5],
                    help="overlap: the X values (ms of pure-Python work per step)")
    ap.add_argument("--output-kind", choices=("CUMULATIVE", "DELTA", "FINAL_ONLY"),
                    default="CUMULATIVE", help="the requests' output_kind (what each step "
                    "builds for them: everything so far, what is new, or nothing until the end)")
    ap.add_argument("--host-cores", type=int, default=0,
                    help="CPUs kept for this (host) thread, XLA's pool on the others, set "
                    "before the backend starts (jaxserve/runtime/host_cores.py)")
    args = ap.parse_args(argv)
    if args.host_cores:
        from jaxserve.runtime.host_cores import reserve_host_cores
        print(reserve_host_cores(args.host_cores).describe())
    engine = engine_in_steady_decode(args.seqs, args.steps, args.output_kind)
    if args.pin:
        pin_device_threads()
    print(f"load average {os.getloadavg()}")
    if args.mode == "hostonly":
        print(f"host-only CPU ms per engine step: {host_only(engine, args.repeats)}")
        return
    if args.mode == "prof":
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        return
    calls = captured_calls(engine, args.steps)
    for _ in range(args.repeats):
        wall, cpu = replay(engine.runner, calls)
        line = f"bare {1e3 * wall:.3f} ms/call, cores busy {cpu / wall:.2f}"
        if args.mode == "overlap":
            line += "".join(f"; X={x}: {1e3 * overlapped(engine.runner, calls, x):.3f} ms"
                            for x in args.busy_ms)
        print(line, f"(load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
