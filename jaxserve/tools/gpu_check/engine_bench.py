"""Sections `e2e_smollm2` and `e2e_llama3_8b`: engine decode tok/s per variant (bf16 or int4
weights; the Pallas kernels or the XLA backends, the end-to-end baseline) and batch size, with
the engine's per-step host / device-wait breakdown and memory-bandwidth use. Each variant
records the XLA dump modules its compiles added (ctx.step_modules), and SmolLM2's first Pallas
bf16 engine is kept for the decode_trace section, which then needs no compile of its own."""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import statistics
import time
import traceback

from jaxserve.tools.gpu_check.context import Ctx, importable, next_pow2
from jaxserve.tools.gpu_check.profiles import NOMINAL_BW, TOKEN_LOW, model_configs
from jaxserve.tools.gpu_check.step_dump import dump_modules


def decode_run(engine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """Fixed-length prompts, EOS ignored, greedy. Decode time runs from the step in which the
    last request got its first token to the end, so prefill is excluded."""
    import numpy as np
    from jaxserve import SamplingParams
    vocab = engine.model.config.vocab_size
    prompts = np.random.default_rng(seed).integers(TOKEN_LOW, min(vocab, 40000),
                                                   size=(batch, prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    compiled = engine.runner.num_compiled
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(engine.next_request_id(), p.tolist(), params)
    counts, t_dec, base, steps, now = {}, None, 0, 0, t0
    stats = []  # the engine's StepStats of each decode step
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            counts[o.request_id] = len(o.outputs[0].token_ids)
        if t_dec is None:
            if len(counts) == batch:
                t_dec, base = now, sum(counts.values())
        else:
            steps += 1
            if engine.last_step is not None:
                stats.append(engine.last_step)
    total = sum(counts.values())
    dec_s = now - t_dec if t_dec is not None else float("nan")
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "generated": total, "all_lengths_ok": all(v == new_tokens for v in counts.values()),
            "wall_s": now - t0, "overall_tok_s": total / (now - t0),
            "decode_steps": steps, "decode_s": dec_s,
            "decode_tok_s": (total - base) / dec_s if steps else float("nan"),
            "decode_steps_per_s": steps / dec_s if steps else float("nan"),
            "compiles_during_run": engine.runner.num_compiled - compiled,
            "step_breakdown": step_breakdown(stats)}


def step_breakdown(stats) -> dict:
    """Median seconds per decode step from the engine's own step statistics
    (jaxserve/telemetry/step_stats.py): host work (schedule, launch, postprocess) against the
    time blocked on the device (wait), and the host's share of the step."""
    if not stats:
        return {"steps": 0}
    med = {name: statistics.median(getattr(st, name) for st in stats)
           for name in ("schedule_s", "device_s", "wait_s", "postprocess_s")}
    total = statistics.median(st.total_s for st in stats)
    host = statistics.median(st.total_s - st.wait_s for st in stats)
    return {"steps": len(stats), **{f"median_{k}": v for k, v in med.items()},
            "median_launch_s": statistics.median(st.device_s - st.wait_s for st in stats),
            "median_host_s": host, "median_total_s": total,
            "host_fraction": host / total if total > 0 else float("nan"),
            "median_h2d_bytes": statistics.median(st.h2d_bytes for st in stats)}


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: all params, less the embedding table when the LM
    head is separate (only a few embedding rows are gathered)."""
    import jax
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    if not model.config.tie_word_embeddings:
        total -= model.params["embedding"].nbytes
    return int(total)


def ensure_params_on_device(engine) -> str | None:
    """The engine's int4 quantization may leave numpy (host) arrays in the params, which jit
    would re-send every step; move them to the device so the kernel path is what is timed."""
    import jax
    import numpy as np
    if not any(isinstance(x, np.ndarray) for x in jax.tree.leaves(engine.model.params)):
        return None
    model = dataclasses.replace(engine.model, params=jax.device_put(engine.model.params))
    engine.model = engine.runner.model = model
    return ("engine left quantized params as host numpy arrays (jit would copy them to the "
            "device every step); moved to the device by gpu_check")


def parse_backend(label: str) -> tuple[str, str, bool]:
    """(attention and linear backend, EngineConfig.gpu_kernels, fused_linears) of a variant's
    backend label: "pallas", "pallas/triton", "pallas/unfused", "pallas/triton/unfused"."""
    backend, *options = label.split("/")
    bad = [o for o in options if o not in ("triton", "mosaic", "unfused")]
    if bad:
        raise ValueError(f"unknown backend option(s) {bad} in {label!r}")
    kernels = next((o for o in options if o in ("triton", "mosaic")), "auto")
    return backend, kernels, "unfused" not in options


def build_llm(ctx: Ctx, model, quantization, backend: str | None = None):
    """An engine sized for the benchmark: a token budget that admits every prompt in the first
    step (so decode runs at one batch bucket and only a few programs compile), a KV cache for
    max_num_seqs full-length sequences, and no warm-up (the first run compiles what it uses).
    backend: attention and linear backend both (default: the profile's Pallas one); a
    "/triton" or "/mosaic" option forces the Pallas kernels' backend (EngineConfig.gpu_kernels;
    otherwise "auto": Mosaic GPU on the H200), "/unfused" turns the fused linears off."""
    from jaxserve import LLM
    p = ctx.prof
    backend, kernels, fused = parse_backend(backend or p.backend)
    seqs = max(p.e2e_batches)
    pages = seqs * -(-p.max_model_len // p.block_size) + 2
    kv = pages * p.block_size * model.config.kv_bytes_per_token(2 if model.dtype == "bfloat16"
                                                                  else 4)
    t0 = time.perf_counter()
    llm = LLM(model, attention_backend=backend, linear_backend=backend,
              gpu_kernels=kernels, fused_linears=fused, quantization=quantization or "none",
              max_num_seqs=seqs, max_model_len=p.max_model_len,
              max_num_batched_tokens=next_pow2(max(512, seqs * (p.prompt_len + 1))),
              kv_cache_memory=int(kv), block_size=p.block_size, warmup=False)
    note = ensure_params_on_device(llm.engine)
    return llm, time.perf_counter() - t0, note


def variant_label(name: str, quantization, backend: str) -> str:
    return f"{name}/{quantization or 'bf16'}/{backend}"


def bench_variant(ctx: Ctx, name: str, model, quantization, backend: str,
                  keep: bool = False) -> dict:
    """One engine (bf16 or int4 weights, a backend) at every batch size: a warm-up run
    compiles, a second is timed. keep: the engine stays in ctx.trace_engine."""
    p = ctx.prof
    modules_before = dump_modules(ctx)
    llm, build_s, note = build_llm(ctx, model, quantization, backend)
    wbytes = weight_bytes_per_step(llm.engine.model)
    res = {"quantization": quantization or "none (bf16)", "backend": backend,
           "construct_s": build_s, "weight_bytes_per_step": wbytes, "runs": []}
    if note:
        res["note"] = note
    kv_tok = model.config.kv_bytes_per_token(2)
    for batch in p.e2e_batches:
        if ctx.over_budget():
            res["runs"].append({"batch": batch, "skipped": ctx.budget_reason()})
            continue
        warm = decode_run(llm.engine, batch, p.prompt_len, p.new_tokens, seed=batch)
        run = decode_run(llm.engine, batch, p.prompt_len, p.new_tokens, seed=batch + 1)
        if run["compiles_during_run"]:  # e.g. a config registered lazily during the warm-up
            again = decode_run(llm.engine, batch, p.prompt_len, p.new_tokens, seed=batch + 2)
            again["compiles_in_discarded_run"] = run["compiles_during_run"]
            run = again
        run["warmup_wall_s"] = warm["wall_s"]
        sps = run["decode_steps_per_s"]
        kv_step = batch * (p.prompt_len + p.new_tokens / 2) * kv_tok
        for kind, bw in (("nominal", NOMINAL_BW), ("measured_copy", ctx.bandwidth.get("copy")),
                         ("measured_read", ctx.bandwidth.get("read"))):
            if bw:
                run[f"mbu_weights_vs_{kind}"] = wbytes * sps / bw
                run[f"mbu_weights_kv_vs_{kind}"] = (wbytes + kv_step) * sps / bw
        res["runs"].append(run)
        ctx.log(f"  {variant_label(name, quantization, backend)} batch {batch}: "
                f"{run['decode_tok_s']:.1f} decode tok/s, {sps:.1f} steps/s")
    label = variant_label(name, quantization, backend)
    ctx.step_modules[label] = sorted(dump_modules(ctx) - modules_before)
    res["dump_modules"] = ctx.step_modules[label]
    if keep:
        ctx.trace_engine = (label, llm)
    del llm
    gc.collect()
    return res


def bench_model(ctx: Ctx, name: str, model, source: str, variants: tuple,
                keep_first: bool = False) -> dict:
    """Every (quantization, backend) variant in order, each only with variant_min_s left.
    keep_first: the first variant's engine stays in ctx.trace_engine (for decode_trace)."""
    res = {"model": name, "source": source, "config": model.config.to_dict(),
           "num_params": model.config.num_params(), "block_size": ctx.prof.block_size,
           "max_model_len": ctx.prof.max_model_len, "variants": []}
    skipped = []
    for i, (quant, backend) in enumerate(variants):
        if ctx.remaining() < ctx.prof.variant_min_s:
            why = (ctx.budget_reason() if ctx.over_budget() else
                   f"{ctx.remaining():.0f}s left, a variant needs {ctx.prof.variant_min_s:.0f}s")
            res["variants"].append({"quantization": quant, "backend": backend, "skipped": why})
            skipped.append(variant_label(name, quant, backend))
            continue
        try:
            res["variants"].append(bench_variant(ctx, name, model, quant, backend,
                                                 keep=keep_first and i == 0))
        except Exception as e:  # noqa: BLE001 - the other variants still run
            res["variants"].append({"quantization": quant, "backend": backend,
                                    "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()[-2000:]})
            res["_status"] = "error"
        gc.collect()
    if skipped and "_status" not in res:
        res["_status"], res["_reason"] = "partial", f"skipped variants {skipped}"
    ctx.engine_results[name] = res
    return res


def section_e2e_llama3_8b(ctx: Ctx) -> dict:
    from models.random_init import random_model
    t0 = time.perf_counter()
    model = random_model(model_configs(ctx.args.dry_run)["llama3_8b"], "bfloat16")
    init_s = time.perf_counter() - t0
    res = bench_model(ctx, "llama3_8b", model, "random weights (models.random_init)",
                      ctx.prof.e2e_variants_8b)
    res["init_s"] = init_s
    return res


def load_smollm2(ctx: Ctx):
    """(model, source): the GGUF when given and loadable, else random SmolLM2-shaped weights."""
    from models.random_init import random_model
    path = ctx.args.gguf
    why = None
    if not path:
        why = "no --gguf given"
    elif not pathlib.Path(path).is_file():
        why = f"--gguf {path} does not exist here"
    else:
        why = importable("gguf")
        if why is None:
            from models import load_model
            try:
                return load_model(path, "bfloat16", compilation_cache=False), f"gguf {path}"
            except Exception as e:  # noqa: BLE001 - fall back to random weights
                why = f"loading {path} failed: {type(e).__name__}: {e}"
        else:
            why = f"gguf package not importable ({why})"
    cfg = model_configs(ctx.args.dry_run)["smollm2"]
    return random_model(cfg, "bfloat16"), f"random weights, SmolLM2 config ({why})"


def section_e2e_smollm2(ctx: Ctx) -> dict:
    model, source = load_smollm2(ctx)
    keep = "decode_trace" in ctx.args.sections.split(",")
    return bench_model(ctx, "smollm2", model, source, ctx.prof.e2e_variants, keep_first=keep)
