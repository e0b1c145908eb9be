"""Prometheus metrics of one app, in its own CollectorRegistry (no global registry).

Latencies are measured by the handlers from the HTTP arrival (what a client feels); engine
state (running, waiting, KV usage, preemptions, compiles) is read at scrape time from the
engine loop's last stats snapshot.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
