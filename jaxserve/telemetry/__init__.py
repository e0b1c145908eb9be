"""What the engine measures every step: step timings and totals (step_stats), KV memory
accounting (kv_accounting) and jax.profiler captures (profiling). Research tools that read a
model or a compiled program once (kv-size, workloads, deviceless reports) live in jaxserve/tools."""
