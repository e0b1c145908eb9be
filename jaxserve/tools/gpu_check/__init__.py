"""The GPU check (scripts/gpu_check.py is its command line and manual), one module per role:

  profiles            what runs: the GPU profile, the CPU dry-run profile, budgets and caps
  context             run state (the run's and the section's deadline, measured bandwidth,
                      cached inputs) and timing helpers
  guards              the stderr log, the per-section hard cap, SIGTERM, the watchdog
  preflight           section `preflight`: nvidia-smi, devices, versions; stops a GPU-less run
  environment         section `bandwidth`
  kernel_inputs       the kernel tests' cases (pallas_kernels/cases.py) at GPU sizes
  kernel_correctness  section `kernel_correctness`: kernels against their references
  kernel_timings      section `kernel_timings`: kernels against the engine's XLA paths
  int4_timing         the int4 kernel beside a bf16 dequantize-then-matmul and jnp.int4
  lora_kernel         the LoRA kernel's check and timing
  gmm_timing          the MoE grouped matmul kernels (Triton, Mosaic GPU) beside ragged_dot
  launch_floor        section `launch_floor`: time per tiny kernel in one jitted chain
  engine_bench        sections `e2e_smollm2` and `e2e_llama3_8b`: Pallas and XLA engines
  decode_trace        section `decode_trace`: a profiler trace of warm decode steps
  trace_reader        a trace read into per-kernel times, busy time and gaps
  llm_defaults        section `llm_defaults`: plain `LLM(model)`
  hf_peer             section `hf_peer`: HF transformers on the same device
  kernel_tests        section `kernel_tests`: `pytest -m gpu` on the kernel tests
  step_dump           section `step_dump`: XLA's dump of the compiled engine steps
  prediction          section `prediction`: the performance model's prediction beside the trace
  report              gpu_check.json and gpu_check.md
  bundle              the out dir's three files and their limits; the tar of dumps
  driver              arguments and the run: sections in order, the bundle at the end

Nothing imports jax at module level: the driver sets JAX_PLATFORMS and XLA_FLAGS first.
"""
