"""Section `decode_trace`: a jax.profiler trace of a few warm decode steps of the SmolLM2 engine
(Pallas backends, bf16; the one e2e_smollm2 kept, else a fresh one), read back into per-kernel
device times and the gaps between kernels (trace_reader). The trace files stay in the scratch
folder for the bundle; the per-kernel times go to ctx.decode_trace for `prediction`."""

from __future__ import annotations

import gc
import time

from jaxserve.tools.gpu_check.context import Ctx
from jaxserve.tools.gpu_check.profiles import TOKEN_LOW
from jaxserve.tools.gpu_check.trace_reader import read_trace

WARM_DECODE_STEPS = 2  # decode steps after the prefill and before the trace starts


def trace_dir(ctx: Ctx):
    return ctx.scratch / "trace"


def engine_for_trace(ctx: Ctx):
    """(label, LLM): the engine e2e_smollm2 kept (its first variant), else a new one."""
    if ctx.trace_engine is not None:
        label, llm = ctx.trace_engine
        return label, llm, 0.0
    from jaxserve.tools.gpu_check.engine_bench import build_llm, load_smollm2
    model, _ = load_smollm2(ctx)
    llm, build_s, _ = build_llm(ctx, model, None)
    return f"smollm2/bf16/{ctx.prof.backend} (built here)", llm, build_s


def traced_decode(ctx: Ctx, engine, batch: int) -> dict:
    """Prefill `batch` rows, run WARM_DECODE_STEPS decode steps (the programs compile there if
    not before), then trace prof.trace_steps decode steps; the rest finishes untraced. Stops
    starting steps once over budget."""
    import jax
    import numpy as np
    from jaxserve import SamplingParams
    steps = ctx.prof.trace_steps
    vocab = engine.model.config.vocab_size
    prompts = np.random.default_rng(11).integers(TOKEN_LOW, min(vocab, 40000),
                                                 size=(batch, ctx.prof.prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=WARM_DECODE_STEPS + steps + 2,
                            ignore_eos=True)
    for p in prompts:
        engine.add_request(engine.next_request_id(), p.tolist(), params)
    started = set()
    while len(started) < batch and engine.has_unfinished_requests():  # prefill
        started |= {o.request_id for o in engine.step()}
    for _ in range(WARM_DECODE_STEPS):
        engine.step()
    compiled = engine.runner.num_compiled
    traced, step_s, skipped = 0, [], None
    t0 = time.perf_counter()
    with jax.profiler.trace(str(trace_dir(ctx))):
        for _ in range(steps):
            if ctx.over_budget():
                skipped = f"{steps - traced} steps not traced: {ctx.budget_reason()}"
                break
            s0 = time.perf_counter()
            engine.step()  # returns once the step's tokens are on the host
            step_s.append(time.perf_counter() - s0)
            traced += 1
    trace_s = time.perf_counter() - t0
    while engine.has_unfinished_requests() and not ctx.over_budget():
        engine.step()
    from jaxserve.tools.gpu_step import weight_bytes
    model = engine.model
    # What the performance model needs to cost the traced step (section `prediction`): the
    # live rows, their context at mid-trace, the weights a step reads, the model's shape.
    ctx.trace_shape = {"config": model.config, "max_num_seqs": engine.config.max_num_seqs,
                       "max_model_len": engine.config.max_model_len,
                       "block_size": engine.config.block_size}
    out = {"batch": batch, "traced_steps": traced, "trace_wall_s": trace_s,
           "host_step_s": step_s, "compiles_while_traced": engine.runner.num_compiled - compiled,
           "context_len": ctx.prof.prompt_len + WARM_DECODE_STEPS + max(1, traced // 2),
           "weight_bytes": weight_bytes(model.params, model.config)}
    if skipped:
        out["skipped"] = skipped
    return out


def section_decode_trace(ctx: Ctx) -> dict:
    label, llm, build_s = engine_for_trace(ctx)
    ctx.trace_engine = None
    try:
        engine = llm.engine
        batch = min(ctx.prof.trace_batch, engine.config.max_num_seqs)
        run = traced_decode(ctx, engine, batch)
    finally:
        del llm
        gc.collect()
    summary = read_trace(trace_dir(ctx), run["traced_steps"])
    ctx.decode_trace = summary
    res = {"engine": label, "build_s": build_s, **run, "trace": summary,
           "trace_dir": str(trace_dir(ctx))}
    if "error" in summary:
        res["_status"] = "failed"
    elif run.get("skipped"):
        res["_status"], res["_reason"] = "partial", run["skipped"]
    return res


def md_decode_trace(r: dict) -> list[str]:
    t = r["trace"]
    if "error" in t:
        return [f"- {r['engine']}: {t['error']}"]
    g = t.get("gaps", {})
    out = [f"- {r['engine']}, batch {r['batch']}, {r['traced_steps']} warm decode steps traced "
           f"({t.get('source')}): {t.get('kernels_per_step', 0):.0f} kernels/step, busy "
           f"{t.get('busy_s_per_step', 0) * 1e3:.3f} ms of {t.get('wall_s_per_step', 0) * 1e3:.3f}"
           f" ms wall per step ({t.get('busy_fraction', 0):.0%}), gaps: mean "
           f"{g.get('mean_us', 0):.1f} us, median {g.get('median_us', 0):.1f} us, max "
           f"{g.get('max_us', 0):.0f} us", "",
           "| kernel | per step | mean us | ms/step | share of busy |", "|---|---|---|---|---|"]
    for k in t.get("top", []):
        out.append(f"| `{k['kernel'][:60]}` | {k['per_step']:.1f} | {k['mean_us']:.1f} | "
                   f"{k['s_per_step'] * 1e3:.3f} | {k['share_of_busy']:.1%} |")
    return out
