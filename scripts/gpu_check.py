"""GPU check: the one prepared script to run when an H200 is lent (see docs/gpu.md).

One command of at most 10 minutes, inside about 15 minutes of device time with the machine's
start. Run it as

    python scripts/gpu_check.py --out-dir $OUT [--gguf SmolLM2.gguf]     # timeout_s=540
    python scripts/gpu_check.py --dry-run --out-dir /tmp/gc    # CPU, interpret-mode kernels

What comes back is three files under --out-dir, within what the lent machine returns (at most 8
files of 16 MiB, 64 MiB together, no deeper than $OUT/a/b/file, names of [A-Za-z0-9._-]):

  gpu_check.json          every section's status and result, rewritten after each section
  gpu_check.md            the summary (also printed at the end)
  gpu_check_dumps.tar.gz  filtered dumps, under 15 MiB: the profiler trace, the ptxas -v log,
                          the traced decode step's optimized HLO, thunk sequence and PTX, the
                          other engine variants' modules, the stderr log; MANIFEST.json inside
                          says what was truncated or left out

Dumps and traces are written to a scratch folder first (--scratch-dir, default a new temporary
folder; never inside --out-dir). Sections, in order; each records ok / partial / skipped /
failed / error with a reason, and one failing does not stop the others:

  preflight          nvidia-smi, jax.devices(), versions, device memory. No GPU visible (and
                     not --dry-run): the run stops here, exit status 2, and the record of why
                     still comes back
  bandwidth          measured copy and read bandwidth, dispatch floor, bf16 matmul rate
  kernel_correctness every Pallas kernel case (paged and ragged attention, int4 matmul, LoRA,
                     an f32 ragged step, a > 4 GiB cache, and each check registered in
                     pallas_kernels.cases.GPU_CHECK_CASES) against its jnp reference
  kernel_tests       the kernel test suite compiled on the GPU (`pytest -m gpu`), capped
  kernel_timings     the kernels timed against the measured bandwidth, beside XLA: the
                     engine's XLA attention; for int4 a bf16 dequantize-then-matmul and XLA's
                     native jnp.int4 dot (and dense bf16); for the MoE grouped matmul (Triton
                     and Mosaic GPU, bf16 and int8 weights) jax.lax.ragged_dot
  launch_floor       a jitted chain of N tiny dependent kernels (one CUDA graph) for two N:
                     microseconds per kernel
  e2e_smollm2        engine decode tok/s, bf16 and int4 weights, the Pallas backends and the
                     XLA ones (attention_backend = linear_backend = "xla"), batch 1 and 64
  decode_trace       a jax.profiler trace of a few warm decode steps of the Pallas bf16
                     engine, read back (jax.profiler.ProfileData) into per-kernel device
                     seconds per step (`per_kernel_s`: kernel -> seconds), busy vs wall time
                     and the gaps between kernels
  llm_defaults       a short run of plain `LLM(model)`: every engine setting at its default
  e2e_llama3_8b      as e2e_smollm2 on a random Llama-3-8B-shaped model
  hf_peer            HF transformers `generate` on the same GPU, SmolLM2 shapes, bf16
  step_dump          the compiled steps' dump: modules per engine variant, the traced step's
                     modules, the compiled-program reader's counts, ptxas registers / spills
  prediction         the deviceless performance model (jaxserve/tools/perf_model.py) on the
                     traced step's dump: predicted step and per-kernel times beside the
                     measured ones, and the model's constants fitted to the trace

Time: --time-budget (default 380 s on a GPU) is checked between sections and inside every loop
over cases, baselines, variants, batches and steps; each section also has its own cap
(profiles.py), past which its loops start nothing new, and past cap + 15 s the section is
interrupted (SIGALRM). A watchdog thread writes the report and the bundle and exits (status 3)
at budget + 60 s even if the main thread is stuck in a compile; SIGTERM (e.g. from `timeout`)
also ends in the bundle. With jax's start and the bundle, a default run ends within 8 minutes.

Exit status: 0 all well; 1 a section errored or failed, or the out dir breaks the return
limits; 2 no GPU; 3 the watchdog ended the run. Imports only jax, numpy, flax (and
torch/transformers for the peer, pytest for kernel_tests) besides this repository.
"""

from __future__ import annotations

import sys

from jaxserve.tools.gpu_check.driver import main

if __name__ == "__main__":
    sys.exit(main())
