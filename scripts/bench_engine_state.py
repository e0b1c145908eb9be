"""What the engine view's state snapshot (jaxserve/server/engine_state.py) costs the engine thread.

Two measurements, both on the host (the snapshot never touches the device):
1. Build time of one snapshot as a function of the KV cache's block count, on a real scheduler
   and block manager holding `--seqs` sequences of `--tokens` tokens each (a fake engine with
   just the public attributes the snapshot reads). At the default 5 Hz the engine thread spends
   5 x that per second: the overhead fraction printed is that, independent of the step time.
2. Decode on the tiny random model through the engine, stepped as EngineLoop does, with and
   without `maybe_refresh` (200 ms interval), interleaved over `--rounds` rounds: the ratio of
   step times (noisy on a loaded machine, so the build-time fraction above is the number to
   trust).

    python scripts/bench_engine_state.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.sequence import Sequence
from jaxserve.server.engine_state import StateSampler, snapshot


def fake_engine(num_blocks: int, seqs: int, tokens: int, block_size: int = 16):
    sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=8192,
                                      max_model_len=tokens + 16, block_size=block_size,
                                      num_blocks=num_blocks, enable_prefix_caching=True))
    for i in range(seqs):
        seq = Sequence(f"req-{i}", list(range(i, i + tokens)), SamplingParams(max_tokens=8))
        sched.block_manager.allocate(seq, cached=[])
        sched.running.append(seq)
    return types.SimpleNamespace(
        scheduler=sched, runner=types.SimpleNamespace(slot_of={f"req-{i}": i for i in range(seqs)}),
        config=types.SimpleNamespace(max_num_seqs=seqs, block_size=block_size),
        max_model_len=tokens + 16)


def build_cost(args) -> None:
    print("blocks  seqs  snapshot_ms  fraction_at_5Hz")
    for num_blocks in (1024, 8192, 32768):
        tokens = min(args.tokens, (num_blocks - 1) // args.seqs * 16)
        engine = fake_engine(num_blocks, args.seqs, tokens)
        times = []
        for i in range(20):
            t = time.perf_counter()
            snapshot(engine, {}, i)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        print(f"{num_blocks:6d}  {args.seqs:4d}  {ms:11.3f}  {ms * 5 / 1e3:15.4%}")


def run_decode(engine, sampler: StateSampler | None, num_seqs: int, tokens: int) -> float:
    """Mean wall time of one loop iteration (step + stats [+ maybe_refresh]) over a decode."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [1 + i, 2, 3, 4], params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        if sampler is not None:
            sampler.maybe_refresh(engine, stats, steps)
        steps += 1
    return (time.perf_counter() - start) / steps


def step_ratio(args) -> None:
    from jaxserve.testing import engine_state as fx
    engine = fx.tiny_engine()
    run_decode(engine, None, fx.MAX_NUM_SEQS, 8)  # first-use costs out of the way
    without, with_ = [], []
    sampler = StateSampler(0.2)
    for _ in range(args.rounds):
        without.append(run_decode(engine, None, fx.MAX_NUM_SEQS, 100))
        with_.append(run_decode(engine, sampler, fx.MAX_NUM_SEQS, 100))
    a, b = statistics.median(without), statistics.median(with_)
    print(f"tiny model decode, {fx.MAX_NUM_SEQS} seqs, {engine.scheduler.block_manager.num_blocks}"
          f" blocks: step {a * 1e3:.3f} ms without, {b * 1e3:.3f} ms with the 200 ms snapshot "
          f"(ratio {b / a:.4f}; {sampler.num_built} snapshots, "
          f"{sampler.build_seconds / max(1, sampler.num_built) * 1e3:.3f} ms each)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    build_cost(args)
    step_ratio(args)


if __name__ == "__main__":
    main()
