"""Research tools around the engine, run once rather than every step: KV sizing (kv_size),
synthetic workloads (workload), and the deviceless GPU reports (gpu_step, compiled_report,
deviceless, hlo_text, thunks; cuda_plugin finds setup's compiler plugin). What the engine
measures every step is jaxserve/telemetry."""
