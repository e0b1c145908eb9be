"""Per-step statistics of the engine: batch shape, tokens, and where the step's time went.

`StepStats` is one step; `StepTotals` keeps running sums and fixed-bucket histograms (plain
Python, so /metrics can turn them into Prometheus histograms at scrape time).

Time split of one `LLMEngine.step()`:
- schedule: the scheduler building the batch (block allocation, preemption);
- device: the runner turning the batch into arrays and launching the step, plus `wait`;
- wait (part of device): blocked on the device for sampled ids. With asynchronous scheduling
  that is the previous step's ids, fetched after this step was launched, so the host work of
  this step overlapped the device work of the previous one;
- postprocess: detokenizing, stop checks, scheduler update, building outputs.
h2d_bytes: host-to-device bytes of the step's calls (inputs, slot-state deltas, block copies).
"""

from __future__ import annotations

import bisect
import dataclasses
import time

STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepStats:
    step: int                 # 0-based index among the engine's non-empty steps
    num_seqs: int             # sequences in the batch
    num_prefill_seqs: int     # of which run a prefill chunk
    num_decode_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int          # tokens generated this step (prefill chunks that end sample one)
    num_preempted: int
    kv_blocks_used: int       # after the step
    schedule_s: float
    device_s: float
    postprocess_s: float
    wait_s: float = 0.0
    h2d_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.device_s + self.postprocess_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "num_tokens": self.num_tokens,
                "total_s": self.total_s}


class Histogram:
    """Counts per upper bound (cumulative only when exported) plus the sum, like Prometheus."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out

    def to_dict(self) -> dict:
        return {"buckets": self.cumulative(), "sum": self.sum}


class StepTotals:
    """Running sums over every step since the engine started."""

    SUMMED = ("num_prefill_tokens", "num_decode_tokens", "num_sampled", "num_preempted",
              "schedule_s", "device_s", "postprocess_s", "wait_s", "h2d_bytes")

    def __init__(self):
        self.num_steps = 0
        self.sums = dict.fromkeys(self.SUMMED, 0)
        self.max_num_seqs = 0
        self.histograms = {"step_seconds": Histogram(STEP_TIME_BUCKETS),
                           "batch_size": Histogram(BATCH_BUCKETS),
                           "batch_tokens": Histogram(TOKEN_BUCKETS)}

    def record(self, s: StepStats) -> None:
        self.num_steps += 1
        for name in self.SUMMED:
            self.sums[name] += getattr(s, name)
        self.max_num_seqs = max(self.max_num_seqs, s.num_seqs)
        self.histograms["step_seconds"].observe(s.total_s)
        self.histograms["batch_size"].observe(s.num_seqs)
        self.histograms["batch_tokens"].observe(s.num_tokens)

    def to_dict(self) -> dict:
        return {"num_steps": self.num_steps, **self.sums, "max_num_seqs": self.max_num_seqs,
                "histograms": {k: h.to_dict() for k, h in self.histograms.items()}}


def timed_steps(engine):
    """Steps `engine` until no request is unfinished; yields (wall seconds of the step() call,
    engine.last_step) for each call once a step has been recorded (benchmark scripts)."""
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        if engine.last_step is not None:
            yield wall, engine.last_step
