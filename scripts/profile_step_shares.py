"""Where a quantized CPU step's time goes, op by op: a jax.profiler trace grouped into shares.

Builds the runner as the engine does for `--quantization` (default w8a8: XLA's int8 dot with
int8 activations; the LM head int8 too), lays out one step of `--rows` decode rows with `--ctx`
tokens of context each (or, with --mixed, `--rows - 1` decodes and one prefill chunk filling the
512-token budget), and times it per variant:
- `cpu-scan`: the engine's W8A8 program (native CPU attention, layers in a scan);
- `cpu-unroll`: layers unrolled (no per-step copy of each layer's slice of the stacked weights);
- `stub-scan`: attention replaced by the K/V write only (the difference is attention's share);
- `xla-scan`: the XLA ragged attention instead of the native kernel.
Then traces `--trace` (a variant) for 3 steps and sums each op's time by the part of the model
its HLO metadata names: attention (the native call), layer linears, the scan's weight slices,
LM head, sampling, norms and glue. "thread-ms" are per-op durations summed over the XLA
threads (pool work an op hands to other threads is not in them); on one core (`taskset -c 0`)
they add up to the step.

    .venv/bin/python scripts/profile_step_shares.py --trace cpu-scan
    taskset -c 0 .venv/bin/python scripts/profile_step_shares.py --variants cpu-scan --trace cpu-scan

The machine is shared: compare variants of one run (cpu-ms, the process's CPU time per step, is
steadier than wall time when another process holds a core).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import statistics
import tempfile
import time

import jax
import numpy as np

import profile_step  # noqa: E402
from jaxserve.quantization.paths import prepare_model  # noqa: E402
from jaxserve.runtime import backends  # noqa: E402
from jaxserve.runtime.runner import ModelRunner  # noqa: E402
from jaxserve.runtime.runner_factory import build_runner, prepare_weights  # noqa: E402
from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram  # noqa: E402

MAX_NUM_SEQS, BUDGET, BLOCK, MAX_LEN = 64, 512, 16, 1024  # bench_throughput.py's engine
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=220)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--quantization", default="w8a8", help="a quantization path, or 'none'")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--variants", default="cpu-scan,stub-scan")
    ap.add_argument("--trace", default="", help="a variant to trace (empty: none)")
    ap.add_argument("--mixed", action="store_true", help="decodes + one prefill chunk")
    ap.add_argument("--power-of-two-buckets", action="store_true",
                    help="the token buckets without the CPU's 3/4 decode points")
    return ap.parse_args(argv)


def build(args):
    """(model with weights prepared for this machine's linear backend, its quantization path,
    that backend): repacked once here, not again for each variant's runner."""
    from models import load_model
    model = load_model("smollm2-135m", "float32")
    model, path = prepare_model(model, None if args.quantization == "none" else args.quantization)
    kind = backends.resolve("auto")
    return prepare_weights(model, StepProgram(linear_backend=kind)), path, kind


def runner_for(variant: str, model, path, kind: str, num_blocks: int, args) -> ModelRunner:
    attention, loop = variant.split("-")
    program = StepProgram(attention_backend="cpu" if attention == "cpu" else "xla",
                          linear_backend=kind, unroll_layers=loop == "unroll",
                          fine_decode_buckets=not args.power_of_two_buckets,
                          kv_cache_dtype=args.kv_cache_dtype)
    spec = RunnerSpec(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET, block_size=BLOCK,
                      max_model_len=MAX_LEN, num_blocks=num_blocks, program=program)
    stub = profile_step.NoAttention() if attention == "stub" else None
    return build_runner(model, spec, quantization=path, attention=stub)


def category(op: str, op_name: str) -> str:
    if op.startswith("ffi_call"):
        return "attention (native call)"
    if "lm_head" in op_name:
        return "LM head (int8 dot + dequant)"
    if "sampling" in op_name or op.startswith("wrapped_reduce-window"):
        return "sampling"  # (the argmax's min-reduction carries no metadata)
    if "dynamic-slice" in op or "dynamic_slice" in op_name or "dynamic_index" in op_name:
        return "scan weight slices"
    if any(f"/{k}/" in op_name for k in LINEARS):
        return "layer linears (act. quant + dot + scale)"
    if "norm" in op_name:
        return "norms"
    if "attention" in op_name or "attn" in op_name:
        return "attention glue (XLA: rope, K/V write)"
    if "mlp" in op_name:
        return "mlp glue"
    if "Await" in op or op.startswith("end:"):
        return "pool waits"
    return "other"


def shares(runner: ModelRunner, call, steps: int = 3) -> dict[str, float]:
    """thread-ms per step by category, from a trace of `steps` runs of `call`."""
    op_names = {}
    for line in runner._executable(call).as_text().splitlines():
        m = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', line)
        if m:
            op_names[m.group(1)] = m.group(2)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(steps):
            jax.block_until_ready(runner.run(call).tokens)
        jax.profiler.stop_trace()
        trace = next(pathlib.Path(d).rglob("*.xplane.pb"))
        data = jax.profiler.ProfileData.from_file(str(trace))
        out = collections.defaultdict(float)
        for plane in data.planes:
            for line in plane.lines:
                if line.name.startswith("python"):
                    continue
                for ev in line.events:
                    if "Execute" not in ev.name:  # the executor's spans contain the ops
                        out[category(ev.name, op_names.get(ev.name, ""))] += \
                            ev.duration_ns / 1e6 / steps
    return dict(out)


def main(argv=None):
    args = parse_args(argv)
    model, path, kind = build(args)
    steps = profile_step.Steps(argparse.Namespace(rows=args.rows, ctx=args.ctx, prefill=BUDGET,
                                                  block_size=BLOCK), -(-MAX_LEN // BLOCK))
    rows, table = steps.mixed() if args.mixed else steps.decode()
    full = np.zeros((MAX_NUM_SEQS + 1, table.shape[1]), np.int32)  # [S + 1, max_blocks]
    full[:args.rows] = table[:args.rows]
    print(f"{args.quantization}, kv {args.kv_cache_dtype}, {args.rows} rows, ctx {args.ctx}"
          f"{', mixed' if args.mixed else ''}; load {os.getloadavg()}", flush=True)
    for variant in args.variants.split(","):
        runner = runner_for(variant, model, path, kind, steps.num_blocks, args)
        call = profile_step.step_call(runner, rows, full)
        jax.block_until_ready(runner.run(call).tokens)  # compile
        walls, cpus = [], []
        for _ in range(args.iters):
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(runner.run(call).tokens)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        print(f"{variant:11s} T={call.shape[0]:4d}: {1e3 * statistics.median(walls):7.1f} ms wall "
              f"(min {1e3 * min(walls):.1f}), {1e3 * statistics.median(cpus):7.1f} cpu-ms; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        if variant == args.trace:
            got = shares(runner, call)
            total = sum(got.values())
            print(f"  shares of {variant} (thread-ms per step, {total:.1f} in all):")
            for name, ms in sorted(got.items(), key=lambda kv: -kv[1]):
                print(f"    {name:42s} {ms:7.2f} ms {100 * ms / total:5.1f}%")
        del runner


if __name__ == "__main__":
    main()
