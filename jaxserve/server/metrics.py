"""Prometheus metrics of one app, in its own CollectorRegistry (no global registry).

Latencies are measured by the handlers from the HTTP arrival (what a client feels); engine
state (running, waiting, KV usage, preemptions, compiles) is read at scrape time from the
engine loop's last stats snapshot.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)


class _EngineCollector:
    """Turns the engine loop's stats snapshot into metric families at scrape time."""

    def __init__(self, loop):
        self._loop = loop

    def collect(self):
        s = self._loop.stats()
        total = max(1, s["kv_blocks_total"])
        yield GaugeMetricFamily("jaxserve_num_requests_running",
                                "Requests in the running batch", s["running"])
        yield GaugeMetricFamily("jaxserve_num_requests_waiting",
                                "Requests waiting for a batch slot", s["waiting"])
        yield GaugeMetricFamily("jaxserve_kv_cache_usage_ratio",
                                "Fraction of KV-cache blocks in use (0..1)",
                                1.0 - s["kv_blocks_free"] / total)
        yield GaugeMetricFamily("jaxserve_kv_cache_blocks_free", "Free KV-cache blocks",
                                s["kv_blocks_free"])
        yield CounterMetricFamily("jaxserve_num_preemptions",
                                  "Sequences preempted for lack of KV blocks",
                                  s["num_preemptions"])
        yield CounterMetricFamily("jaxserve_compiles_after_warmup",
                                  "XLA programs compiled after warm-up (should stay 0)",
                                  s["num_compiles_after_warmup"])
        for unit in ("tokens", "blocks"):
            yield CounterMetricFamily(f"jaxserve_prefix_cache_queries_{unit}",
                                      f"Prompt {unit} looked up in the prefix cache at admission",
                                      s.get(f"prefix_cache_queries_{unit}", 0))
            yield CounterMetricFamily(f"jaxserve_prefix_cache_hits_{unit}",
                                      f"Prompt {unit} found in the prefix cache (not recomputed)",
                                      s.get(f"prefix_cache_hits_{unit}", 0))
        yield GaugeMetricFamily("jaxserve_prefix_cache_blocks",
                                "KV blocks registered in the prefix cache (in use or evictable)",
                                s.get("prefix_cache_blocks", 0))
        yield CounterMetricFamily("jaxserve_kv_cow_copies",
                                  "KV blocks copied on write (a write into a shared block)",
                                  s.get("cow_copies", 0))
        yield GaugeMetricFamily("jaxserve_engine_alive", "1 while the engine loop runs",
                                1.0 if self._loop.alive else 0.0)
        yield from gateway_metrics(s)
        yield from _replica_metrics(s.get("replicas"), s.get("replicas_up"))
        yield from _step_metrics(s)
        yield from _kv_memory_metrics(s)
        yield from _spec_metrics(s.get("speculation"))


def gateway_metrics(s: dict):
    """The model-server protocol of Kubernetes inference gateways (Gateway API Inference
    Extension, llm-d), under the vLLM names their endpoint pickers scrape by default.

    Only the stats keys a pool of replicas can also sum are read: running, waiting,
    kv_blocks_total, kv_blocks_free, block_size; and `lora`, which only one engine reports
    (LoRA is not served by replicas).
    """
    yield GaugeMetricFamily("vllm:num_requests_running",
                            "Requests in the running batch", s["running"])
    yield GaugeMetricFamily("vllm:num_requests_waiting",
                            "Requests queued, not yet scheduled", s["waiting"])
    # A fraction (0..1) despite "perc": vLLM's semantics, which the pickers assume.
    yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use "
                            "(0..1)", 1.0 - s["kv_blocks_free"] / max(1, s["kv_blocks_total"]))
    # vLLM's info-style gauge: value 1, the cache config in its labels (pickers read
    # block_size and num_gpu_blocks from them).
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config",
                             labels=["block_size", "num_gpu_blocks"])
    info.add_metric([str(s["block_size"]), str(s["kv_blocks_total"])], 1.0)
    yield info
    yield from lora_metrics(s.get("lora"))


def lora_metrics(lora: dict | None, now: Callable[[], float] = time.time):
    """vLLM's `vllm:lora_requests_info` (engine.stats()["lora"]; absent without enable_lora):
    the adapters of running and waiting requests, comma-joined, and max_lora in its labels;
    its value the time the labels were read, in seconds since the epoch, as vLLM sets it
    (`set_to_current_time`). vLLM keeps every label set it has seen, each with its last time,
    and gateways read the newest; this exports only the current one, so the newest is it."""
    if lora is None:
        return
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "waiting_lora_adapters",
                                     "running_lora_adapters"])
    info.add_metric([str(lora["max_lora"]), ",".join(lora["waiting_lora_adapters"]),
                     ",".join(lora["running_lora_adapters"])], now())
    yield info
    yield GaugeMetricFamily("jaxserve_lora_adapters_loaded", "LoRA adapters registered "
                            "(servable by name)", lora["loaded"])
    yield CounterMetricFamily("jaxserve_lora_device_loads", "LoRA adapters written into a "
                              "device slot", lora["device_loads"])
    yield CounterMetricFamily("jaxserve_lora_host_loads", "LoRA adapters read from their "
                              "files", lora["host_loads"])


SPEC_COUNTERS = {
    "num_drafts": ("jaxserve_spec_decode_num_drafts", "Drafted rows verified"),
    "num_draft_tokens": ("jaxserve_spec_decode_num_draft_tokens", "Drafted tokens verified"),
    "num_accepted_tokens": ("jaxserve_spec_decode_num_accepted_tokens",
                            "Drafted tokens the target accepted"),
    "num_emitted_tokens": ("jaxserve_spec_decode_num_emitted_tokens",
                           "Tokens verified rows produced (accepted + the target's own)"),
    "num_disabled": ("jaxserve_spec_decode_num_disabled",
                     "Speculation switch-offs for low acceptance"),
    "num_resumed": ("jaxserve_spec_decode_num_resumed",
                    "Switched-off speculation turned back on (drafts scored well again)"),
}


def _spec_metrics(spec: dict | None):
    """Speculative decoding (engine.stats()["speculation"], None without it)."""
    if spec is None:
        return
    for key, (name, text) in SPEC_COUNTERS.items():
        yield CounterMetricFamily(name, text, spec[key])
    yield GaugeMetricFamily("jaxserve_spec_decode_acceptance_rate",
                            "Accepted / drafted tokens since start (0 before any draft)",
                            spec["acceptance_rate"] or 0.0)
    yield GaugeMetricFamily("jaxserve_spec_decode_mean_accepted_length",
                            "Tokens per verified row since start (0 before any draft)",
                            spec["mean_accepted_length"] or 0.0)


REPLICA_GAUGES = {
    "running": ("jaxserve_replica_num_requests_running", "Requests in the replica's batch"),
    "waiting": ("jaxserve_replica_num_requests_waiting", "Requests waiting in the replica"),
}
REPLICA_COUNTERS = {
    "prefix_cache_queries_tokens": ("jaxserve_replica_prefix_cache_queries_tokens",
                                    "Prompt tokens looked up in the replica's prefix cache"),
    "prefix_cache_hits_tokens": ("jaxserve_replica_prefix_cache_hits_tokens",
                                 "Prompt tokens the replica found in its prefix cache"),
}


def _replica_metrics(per_replica: dict | None, up: dict | None):
    """Per engine replica (a pool on Ray Serve; absent with one engine): the unlabelled
    families above are the pool's sums, these say how the load and cache hits split."""
    if not per_replica and not up:
        return
    per_replica = per_replica or {}
    for key, (name, doc) in REPLICA_GAUGES.items():
        family = GaugeMetricFamily(name, doc, labels=["replica"])
        for replica, s in sorted(per_replica.items()):
            family.add_metric([replica], s[key])
        yield family
    usage = GaugeMetricFamily("jaxserve_replica_kv_cache_usage_ratio",
                              "Fraction of the replica's KV-cache blocks in use",
                              labels=["replica"])
    for replica, s in sorted(per_replica.items()):
        usage.add_metric([replica], 1.0 - s["kv_blocks_free"] / max(1, s["kv_blocks_total"]))
    yield usage
    for key, (name, doc) in REPLICA_COUNTERS.items():
        family = CounterMetricFamily(name, doc, labels=["replica"])
        for replica, s in sorted(per_replica.items()):
            family.add_metric([replica], s.get(key, 0))
        yield family
    healthy = GaugeMetricFamily("jaxserve_replica_up", "1 while the pool routes to the "
                                "replica (it answers its health polls)", labels=["replica"])
    for replica, ok in sorted((up or {}).items()):
        healthy.add_metric([replica], 1.0 if ok else 0.0)
    yield healthy


STEP_HISTOGRAMS = {
    "step_seconds": ("jaxserve_step_duration_seconds", "Wall time of one engine step"),
    "batch_size": ("jaxserve_step_batch_size", "Sequences in one engine step"),
    "batch_tokens": ("jaxserve_step_batch_tokens", "Tokens (prefill + decode) in one step"),
}


def _step_metrics(s: dict):
    """From jaxserve/telemetry/step_stats.py: running totals, histograms, and the last step."""
    totals, last = s.get("step_totals"), s.get("last_step")
    if totals is None:
        return
    yield CounterMetricFamily("jaxserve_engine_steps", "Engine steps that ran a batch",
                              totals["num_steps"])
    phase = CounterMetricFamily("jaxserve_step_phase_seconds",
                                "Engine step time by phase: schedule, device (inputs, jitted "
                                "step, fetching ids), postprocess", labels=["phase"])
    for name in ("schedule", "device", "postprocess"):
        phase.add_metric([name], totals[f"{name}_s"])
    yield phase
    tokens = CounterMetricFamily("jaxserve_step_tokens", "Tokens run through the model, by "
                                 "kind", labels=["kind"])
    tokens.add_metric(["prefill"], totals["num_prefill_tokens"])
    tokens.add_metric(["decode"], totals["num_decode_tokens"])
    yield tokens
    for key, (name, doc) in STEP_HISTOGRAMS.items():
        h = totals["histograms"][key]
        yield HistogramMetricFamily(name, doc, buckets=h["buckets"], sum_value=h["sum"])
    if last is not None:
        yield GaugeMetricFamily("jaxserve_last_step_num_seqs", "Sequences in the last step",
                                last["num_seqs"])
        split = GaugeMetricFamily("jaxserve_last_step_tokens", "Tokens in the last step, by kind",
                                  labels=["kind"])
        split.add_metric(["prefill"], last["num_prefill_tokens"])
        split.add_metric(["decode"], last["num_decode_tokens"])
        yield split
    yield GaugeMetricFamily("jaxserve_profiling_active", "1 while a jax.profiler capture runs",
                            1.0 if s.get("profiling") else 0.0)


def _kv_memory_metrics(s: dict):
    """From jaxserve/telemetry/kv_accounting.py: what the paged cache holds and wastes right now."""
    m = s.get("kv_memory")
    if m is None:
        return
    yield GaugeMetricFamily("jaxserve_kv_tokens_stored", "Token slots holding KV",
                            m["tokens"])
    yield GaugeMetricFamily("jaxserve_kv_blocks_used", "KV blocks held by requests (a shared "
                            "block counted once)", m["blocks_used"])
    yield GaugeMetricFamily("jaxserve_kv_slots_wasted", "Slots held in tail blocks but empty "
                            "(internal fragmentation)", m["wasted"])
    yield GaugeMetricFamily("jaxserve_kv_waste_ratio", "Wasted / held slots of the paged cache",
                            m["waste_fraction"])
    contiguous = GaugeMetricFamily(
        "jaxserve_kv_contiguous_waste_ratio", "Wasted / reserved slots a contiguous cache "
        "would have for the running requests", labels=["reservation"])
    contiguous.add_metric(["prompt_plus_max_tokens"], m["contiguous_request_waste_fraction"])
    contiguous.add_metric(["max_model_len"], m["contiguous_max_len_waste_fraction"])
    yield contiguous


class ServerMetrics:
    def __init__(self, loop):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds",
                              "Time from HTTP arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds",
                             "Time from HTTP arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.requests = Counter("jaxserve_request", "Finished sub-requests by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("jaxserve_http_errors", "Error responses by status code",
                              ["status"], registry=r)
        r.register(_EngineCollector(loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)
