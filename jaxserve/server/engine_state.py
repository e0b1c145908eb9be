"""A JSON snapshot of what the engine holds right now, for the web page's engine view.

Built on the engine thread (the only one that may read the engine), from public state of the
scheduler, the block manager and the runner: batch slots, the KV block map, the queues and the
engine's counters. `StateSampler.maybe_refresh` rebuilds it only when the last one is older
than `interval_s`, so its cost is spread over many steps (docs/serving.md has the measured cost);
HTTP threads read the latest snapshot, a dict that is replaced whole and never mutated.

Block map encoding (one entry per block, index = block id, so the lists stay small):
`ref_counts[b]` (0 free, 1 in use, > 1 shared), `cached[b]` (1 when the block is registered in
the prefix cache: a computed full block reusable by a request with the same prefix; free and
cached means evictable) and `owner[b]`, an index into `owners` (a request id) or -1.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("jaxserve.server")

SCHEMA_VERSION = 1
# Counters a client turns into rates (throughput, hit rate) by differencing two snapshots.
COUNTER_KEYS = ("tokens_computed", "prompt_tokens_computed", "num_preemptions", "cow_copies",
                "prefix_cache_queries_tokens", "prefix_cache_hits_tokens",
                "prefix_cache_queries_blocks", "prefix_cache_hits_blocks",
                "prefix_cache_evictions", "num_compiles_after_warmup")
GAUGE_KEYS = ("kv_blocks_total", "kv_blocks_free", "kv_blocks_in_use", "prefix_cache_blocks",
              "running", "waiting")


def _slots(engine) -> list[dict]:
    """The running sequences, each with the batch slot the runner gave it (None: not yet)."""
    slot_of = engine.runner.slot_of
    return [{"slot": slot_of.get(seq.request_id), "request_id": seq.request_id,
             "phase": "prefill" if seq.is_prefill else "decode",
             "prompt_tokens": seq.num_prompt_tokens, "output_tokens": seq.num_output_tokens,
             "computed_tokens": seq.num_computed_tokens, "blocks": len(seq.block_table)}
            for seq in engine.scheduler.running]


def _waiting(engine) -> list[dict]:
    return [{"request_id": seq.request_id, "prompt_tokens": seq.num_prompt_tokens,
             "output_tokens": seq.num_output_tokens,
             "preempted": seq.status.name == "PREEMPTED"}
            for seq in engine.scheduler.waiting]


def _block_map(engine) -> dict:
    """Per-block refcount, cached flag and first holder, in O(blocks held + blocks cached).

    Refcounts are counted from the holders' block tables (a block's refcount is its number of
    table entries, which the block manager's check_invariants enforces) instead of asking the
    block manager for every block: on a cache of tens of thousands of blocks that is most of
    the snapshot's cost.
    """
    bm = engine.scheduler.block_manager
    n = bm.num_blocks
    refs, owner, cached = [0] * n, [-1] * n, [0] * n
    owners: list[str] = []
    sched = engine.scheduler
    for seq in (*sched.running, *sched.waiting):  # the oldest holder names a shared block
        if not seq.block_table:
            continue
        index = len(owners)
        owners.append(seq.request_id)
        for block in seq.block_table:
            refs[block] += 1
            if owner[block] < 0:
                owner[block] = index
    for block in bm.cache.hash_of:
        cached[block] = 1
    return {"num_blocks": n, "block_size": bm.block_size,
            "first_usable": n - bm.num_usable_blocks,
            "ref_counts": refs, "cached": cached, "owner": owner, "owners": owners}


def snapshot(engine, stats: dict, step: int) -> dict:
    """The state of `engine` now (engine thread only); `stats` is its latest engine.stats()."""
    totals = stats.get("step_totals") or {}
    counters = {k: stats.get(k, 0) for k in COUNTER_KEYS}
    counters["num_steps"] = totals.get("num_steps", 0)
    counters["decode_tokens"] = totals.get("num_decode_tokens", 0)
    counters["prefill_tokens"] = totals.get("num_prefill_tokens", 0)
    cfg = engine.config
    return {"version": SCHEMA_VERSION, "time": time.time(), "monotonic": time.monotonic(),
            "loop_iteration": step,
            "config": {"max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size,
                       "max_model_len": engine.max_model_len,
                       "prefix_caching": bool(stats.get("prefix_caching", False))},
            "slots": _slots(engine), "waiting": _waiting(engine),
            "blocks": _block_map(engine),
            "gauges": {k: stats.get(k, 0) for k in GAUGE_KEYS},
            "counters": counters}


class StateSampler:
    """Keeps the latest snapshot, rebuilt at most every `interval_s` (engine thread writes)."""

    def __init__(self, interval_s: float = 0.2):
        if not interval_s > 0:
            raise ValueError(f"the engine state interval must be > 0 seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self._latest: dict | None = None
        self._built_at = float("-inf")
        self._lock = threading.Lock()
        self.num_built = 0
        self.build_seconds = 0.0  # total time spent building snapshots (its cost)
        self.error: Exception | None = None  # the first failure to build one

    def maybe_refresh(self, engine, stats: dict, step: int, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._built_at < self.interval_s:
            return False
        try:
            snap = snapshot(engine, stats, step)
        except Exception as e:  # noqa: BLE001 - a view of the engine must never stop it
            if self.error is None:
                log.warning("the engine state snapshot failed (the engine view will be "
                            "empty): %r", e)
            self.error, self._built_at = e, now
            return False
        done = time.monotonic()
        with self._lock:
            self._latest, self._built_at = snap, now
            self.num_built += 1
            self.build_seconds += done - now
        return True

    def latest(self) -> dict | None:
        with self._lock:
            return self._latest
