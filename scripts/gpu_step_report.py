"""The engine's step compiled for an H200 without a GPU, and what the compiled program does.

For each model shape (SmolLM2-135M, Llama-3.2-1B, a Llama-3-8B-shaped random model, OLMoE-1B-7B's
MoE shape; `gpu_step.model_shapes`), weights
(bf16, int4), step (decode1: the 1-token bucket, one live sequence; decode: the batch-64 token
bucket; mixed: the 512-token bucket that carries decodes and prefill chunks together) and
program variant, it compiles the runner's step deviceless (jax-cuda13-plugin) and prints
kernels / copies / weight copies per layer, launches per step, CUDA graphs, host-synchronising
branches, alias vs KV cache bytes, temporaries, Pallas kernels' registers and spills, compile
seconds (jaxserve/tools/gpu_step.py), and for decode steps the performance model's predicted
H200 step time, tokens/s and MBU at `--context-len` tokens per sequence
(jaxserve/tools/perf_model.py, docs/perf_model.md).

Variants: `gpu` is what the engine runs on an H200 (unrolled layers over per-layer weights, a
branch-free sampler, attention, int4 matmul and MoE grouped matmul on Mosaic GPU); `gpu-triton`
is the same with those kernels on Triton (what GPUs before Hopper run); `loop` is the step as
the CPU runs it (layer loop, lax.cond sampler);
`loop-cublas-dsf` is `loop` with XLA's dynamic-slice fusion into cuBLAS GEMMs; `loop-cmdbuf`
asks XLA to capture loops and conditionals in CUDA graphs too.

  .venv/bin/python scripts/gpu_step_report.py [--json] [--md docs/gpu_step_report_table.md]
      [--context-len 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from jaxserve.tools import cuda_plugin

cuda_plugin.use_setup_plugin()  # before jax is imported: jax looks for plugins then
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: no GPU needed (or used)

import warnings  # noqa: E402

from jaxserve.runtime.runner_spec import LoRASlots  # noqa: E402
from jaxserve.tools import deviceless, gpu_step  # noqa: E402

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

STEPS = {"decode1": 1, "decode": 64, "mixed": 512}
PALLAS = ("ragged_paged_attention", "int4_matmul", "paged_attention",  # ptxas entry names
          "lora_sgmv", "sample_rows",  # the LoRA kernel, once a step carries adapters
          "fused_linear", "merge_splits", "grouped_matmul")  # the MoE experts (Triton)
VARIANTS = {
    # What an H200 runs: attention, int4 and MoE matmuls on Mosaic GPU (gpu_kernels="auto").
    "gpu": dict(unroll_layers=True, branch_free_sampling=True),
    # The same program with those kernels on Triton (gpu_kernels="triton"; older GPUs).
    "gpu-triton": dict(unroll_layers=True, branch_free_sampling=True, gpu_kernels="triton"),
    # The Triton program without the fused-linear kernel: each block's norms, projections,
    # SiLU and residual adds as XLA's fusions and GEMMs (StepProgram.fused_linears off).
    "gpu-triton-unfused": dict(unroll_layers=True, branch_free_sampling=True,
                               gpu_kernels="triton", fused_linears=False),
    # The GPU program with the branch-free sampler in XLA (candidates' top-k and two unrolled
    # bisections) instead of the sampling kernel.
    "gpu-xla-sampler": dict(unroll_layers=True, branch_free_sampling=True,
                            sampler_backend="xla"),
    # XLA merges dots sharing an input (q/k/v, gate/up) only under 32 MB of weights by
    # default: the 8B's 117 MB gate and up stay two GEMMs. Deviceless, the merged GEMM reads
    # both weights in place; not the default until a GPU shows the autotuner does not pick a
    # cuBLAS GEMM over materialised concatenated weights (docs/gpu_step_report.md).
    "gpu-dot-merger": dict(unroll_layers=True, branch_free_sampling=True, compiler_options=(
        ("xla_gpu_dot_merger_threshold_mb", 1024),)),
    "loop": dict(unroll_layers=False, branch_free_sampling=False),
    # The GPU program serving LoRA adapters: 4 slots of rank 16 on all seven projections.
    "gpu-lora": dict(unroll_layers=True, branch_free_sampling=True,
                     lora=LoRASlots(max_loras=4, max_rank=16)),
    "loop-cublas-dsf": dict(unroll_layers=False, branch_free_sampling=False, compiler_options=(
        ("xla_gpu_enable_dynamic_slice_fusion", True), ("xla_gpu_enable_triton_gemm", False))),
    "loop-cmdbuf": dict(unroll_layers=False, branch_free_sampling=False, compiler_options=(
        ("xla_gpu_enable_command_buffer",
         "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"),)),
}
COLUMNS = (("kernels/layer", "kernels_per_layer"), ("copies/layer", "copies_per_layer"),
           ("weight copies/layer", "weight_copies_per_layer"),
           ("launches/step", "launches_per_step"), ("kernels/step", "kernels_per_step"),
           ("CUDA graphs", "command_buffers"), ("host syncs", "host_sync"),
           ("alias MB", "alias_bytes"), ("cache MB", "cache_bytes"),
           ("temp MB", "temp_bytes"), ("LoRA slots MB", "lora_slot_bytes"),
           ("compile s", "compile_s"), ("pred. step us", "predicted_step_us"),
           ("pred. tok/s", "predicted_tokens_per_s"), ("pred. MBU", "predicted_mbu"))


def row(model: str, weights: str, step: str, variant: str, context_len: int = 1024) -> dict:
    spec = gpu_step.StepSpec(config=gpu_step.model_shapes()[model], weights=weights,
                             tokens=STEPS[step], context_len=context_len, **VARIANTS[variant])
    report, extra = gpu_step.step_report(spec)
    out = {"model": model, "weights": weights, "step": step, "variant": variant,
           **report.as_dict(), **extra}
    out.update(prediction_fields(out.pop("kernel_costs"), out.pop("prediction"),
                                 decode=step.startswith("decode"), rows=spec.live_rows,
                                 context_len=context_len))
    # Pallas kernels by name; XLA's own fusions (hundreds) only as a count of those spilling.
    kernels = out.pop("kernels")
    out["pallas_kernels"] = {n: k for n, k in kernels.items() if n.startswith(PALLAS)}
    out["xla_kernels_spilling"] = sum(1 for n, k in kernels.items()
                                      if not n.startswith(PALLAS) and k["spill_bytes"])
    return out


def prediction_fields(costs, p, *, decode: bool, rows: int, context_len: int) -> dict:
    """The model's H200 prediction as report columns (decode steps only: a mixed step's
    prefill rows have no single context length), with its time per scope (layers, sampler,
    the rest) and per kernel kind."""
    if not decode:
        return {"predicted_step_us": None, "predicted_tokens_per_s": None,
                "predicted_mbu": None}
    by_scope, by_kind = {}, {}
    for c, t in zip(costs, p.kernel_s):
        by_scope[c.scope or "other"] = by_scope.get(c.scope or "other", 0.0) + t * 1e6
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + t * 1e6
    return {"context_len": context_len, "live_rows": rows,
            "predicted_step_us": p.step_s * 1e6, "predicted_tokens_per_s": p.tokens_per_s,
            "predicted_mbu": p.mbu, "predicted_floor_us": p.floor_s * 1e6,
            "predicted_overhead_us": p.overhead_s * 1e6, "model_kernels": p.kernels,
            "model_bytes": sum(c.bytes for c in costs),
            "model_flops": sum(c.flops for c in costs),
            "predicted_us_by_scope": by_scope, "predicted_us_by_kind": by_kind}


def fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "predicted_mbu":
        return f"{value:.0%}"
    if key.endswith("_bytes"):
        return f"{value / 1e6:.0f}"
    if isinstance(value, float):
        return f"{value:.1f}" if value != int(value) else str(int(value))
    return str(value)


def pallas_summary(kernels: dict) -> str:
    """Registers/spills of the Pallas kernels."""
    names = list(kernels)
    if not names:
        return "-"
    regs = [kernels[n]["registers"] or 0 for n in names]
    spills = sum(kernels[n]["spill_bytes"] for n in names)
    return f"{len(names)} kernels, {min(regs)}-{max(regs)} regs, {spills} B spilled"


def markdown(rows: list[dict]) -> str:
    head = ["model", "weights", "step", "variant"] + [c for c, _ in COLUMNS] + ["Pallas ptxas"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["weights"], r["step"], r["variant"]]
        cells += [fmt(k, r[k]) for _, k in COLUMNS] + [pallas_summary(r["pallas_kernels"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,llama3.2-1b,llama3-8b")
    ap.add_argument("--weights", default="bf16,int4")
    ap.add_argument("--steps", default="decode1,decode,mixed")
    ap.add_argument("--context-len", type=int, default=1024,
                    help="tokens of context per live sequence, for the predicted figures")
    ap.add_argument("--variants", default="loop,gpu-triton,gpu", help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--md", type=pathlib.Path, help="also write the table here")
    ap.add_argument("--out", type=pathlib.Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    for name, allowed in (("models", gpu_step.model_shapes()), ("weights", ("bf16", "int4")),
                          ("steps", STEPS), ("variants", VARIANTS)):
        bad = [v for v in getattr(args, name).split(",") if v not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}; choose from {sorted(allowed)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    why = deviceless.unavailable_reason()
    if why:
        print(f"cannot compile for an H200 here: {why}", file=sys.stderr)
        return 2
    rows = []
    for model in args.models.split(","):
        for weights in args.weights.split(","):
            for step in args.steps.split(","):
                for variant in args.variants.split(","):
                    rows.append(row(model, weights, step, variant, args.context_len))
                    r = rows[-1]
                    pred = "" if r["predicted_mbu"] is None else (
                        f", predicted H200 {r['predicted_step_us']:.0f} us/step, "
                        f"{r['predicted_mbu']:.0%} MBU at context {args.context_len}")
                    print(f"{model} {weights} {step} {variant}: "
                          f"{r['kernels_per_step']} kernels, "
                          f"{r['weight_copies_per_layer']} weight copies/layer{pred}, "
                          f"{r['compile_s']:.0f} s", file=sys.stderr, flush=True)
                    if args.out:  # after every compile: a long run keeps what it measured
                        args.out.write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    if args.md:
        args.md.write_text(table)
    print(json.dumps(rows, indent=1) if args.json else table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
