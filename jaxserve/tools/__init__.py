"""Research and accounting tools around the engine: KV sizing (kv_size), KV memory accounting
(kv_accounting), jax.profiler captures (profiling), per-step statistics (step_stats) and
synthetic workloads (workload)."""
