"""The GPU check (scripts/gpu_check.py is its command line), one module per role:

  profiles            what runs: the GPU profile, the CPU dry-run profile, nominal H200 figures
  context             run state (budget, measured bandwidth, cached inputs) and timing helpers
  environment         sections `environment` and `bandwidth`
  kernel_inputs       the kernel tests' cases (pallas_kernels/cases.py) at GPU sizes
  kernel_correctness  section `kernel_correctness`: kernels against their references
  kernel_timings      section `kernel_timings`: kernels against the engine's XLA paths
  engine_bench        sections `e2e_smollm2` and `e2e_llama3_8b`: engine decode throughput
  llm_defaults        section `llm_defaults`: plain `LLM(model)`
  step_dump           section `step_dump`: XLA's dump of the compiled engine step
  hf_peer             section `hf_peer`: HF transformers on the same device
  kernel_tests        section `kernel_tests`: `pytest -m gpu` on the kernel tests
  report              gpu_check.json and gpu_check.md
  driver              arguments and the run: sections in order, each under the time budget

Nothing imports jax at module level: the driver sets JAX_PLATFORMS and XLA_FLAGS first.
"""
