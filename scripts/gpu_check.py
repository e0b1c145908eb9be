"""GPU check: the one prepared script to run when an H200 is lent (see docs/gpu.md).

One call fits 8 minutes on a fresh H200 with start-up: a default budget of 330 s, checked
between sections, cases, engine variants and batches (what would start after it is skipped,
with a reason); every section on its own (a failure is recorded and the rest still runs):

  environment        python / jax / jaxlib / plugin versions, devices, device memory
  bandwidth          measured device copy and read bandwidth, dispatch floor, bf16 matmul rate
  kernel_correctness paged attention (decode and ragged) and int4 matmul on the device vs
                     their jnp references, plus an f32 ragged step and one over a > 4 GiB cache
                     (Pallas indexes it with 64-bit offsets)
  kernel_timings     the same cases timed (warm, median) against the nominal 4.3 TB/s and the
                     measured bandwidth, side by side with the XLA paths the engine runs
                     (its XLA ragged attention on the same rows and pages, laid out by
                     step_layout.build; XLA int4 dequantize-matmul)
  e2e_smollm2        engine decode tok/s on SmolLM2-135M (from --gguf if loadable, else random
                     weights), bf16 vs int4, batch 1/64, with the engine's per-step host /
                     device-wait breakdown
  llm_defaults       a short run of plain `LLM(model)`: every engine setting at its default
  e2e_llama3_8b      the same as e2e_smollm2 on a random Llama-3-8B-shaped model
  step_dump          the XLA dump of every engine step compiled above (--xla_dump_to, limited
                     to the step module), saved under --out-dir/xla_dump_step
  hf_peer            HF transformers `generate` on the same GPU, SmolLM2 shapes, bf16
  kernel_tests       the kernel test suite compiled on the GPU (`pytest -m gpu`), where pytest
                     is installed

Kernel inputs and tolerances are the kernel tests' own (pallas_kernels/cases.py), at GPU sizes.
The sections, the report and the run live in jaxserve/tools/gpu_check/; this is their CLI.

    python scripts/gpu_check.py --out-dir $OUT [--gguf SmolLM2.gguf] [--time-budget 330]
    python scripts/gpu_check.py --dry-run --out-dir /tmp/gc    # CPU, interpret-mode kernels

Writes gpu_check.json after every section (a killed run keeps what it finished) and
gpu_check.md at the end, and prints the markdown. Exit status 1 when a section errored or a
kernel was out of tolerance, else 0. Imports only jax, numpy, flax (and torch/transformers for
the peer, pytest for kernel_tests) besides this repository.
"""

from __future__ import annotations

import sys

from jaxserve.tools.gpu_check.driver import main

if __name__ == "__main__":
    sys.exit(main())
