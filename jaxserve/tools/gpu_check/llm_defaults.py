"""Section `llm_defaults`: a short greedy run of plain `LLM(model)`, every engine setting at its
default: what a user gets on this machine."""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import time

from jaxserve.tools.gpu_check.context import Ctx, importable
from jaxserve.tools.gpu_check.profiles import TOKEN_LOW, model_configs


def default_dtype() -> str:
    """The engine's default weight dtype when it names one; else what the GPU defaults should be
    (bf16 on a GPU, f32 on CPU) for the random model, which needs a concrete dtype."""
    import jax
    from jaxserve.config import EngineConfig
    default = EngineConfig.__dataclass_fields__["dtype"].default
    if default in ("float32", "bfloat16", "float16"):
        return default
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def section_llm_defaults(ctx: Ctx) -> dict:
    """A short greedy run of `LLM(model)` with every engine setting at its default (backends,
    KV cache size, buckets, warm-up): what a user gets on this machine. The GGUF by path when
    given (all defaults, dtype included), else random SmolLM2 weights in the default dtype.
    The dry run turns the warm-up off: on CPU compiling every bucket would dominate it."""
    from jaxserve import LLM, SamplingParams
    from models.random_init import random_model
    import numpy as np
    p = ctx.prof
    path = ctx.args.gguf
    overrides = {"warmup": False} if ctx.args.dry_run else {}
    t0 = time.perf_counter()
    if path and pathlib.Path(path).is_file() and importable("gguf") is None:
        llm, source = LLM(path, **overrides), f"gguf {path}"
    else:
        dtype = default_dtype()
        cfg = model_configs(ctx.args.dry_run)["smollm2"]
        llm = LLM(random_model(cfg, dtype), **overrides)
        source = f"random weights, SmolLM2 config, {dtype}"
    construct_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # the structured-output variants compile after warm-up
    warm = llm.engine.wait_until_warm(timeout=max(1.0, ctx.deadline - time.monotonic()))
    masked_s = time.perf_counter() - t0
    vocab = llm.engine.model.config.vocab_size
    prompts = np.random.default_rng(7).integers(TOKEN_LOW, min(vocab, 40000),
                                                size=(p.defaults_prompts, p.prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=p.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([row.tolist() for row in prompts], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    totals = {k: v for k, v in stats["step_totals"].items() if k != "histograms"}
    cfg = llm.engine.config
    res = {"source": source, "overrides": overrides, "construct_s": construct_s,
           "masked_variants_s": masked_s, "masked_variants_ready": warm,
           "generate_s": generate_s,
           "prompts": p.defaults_prompts, "generated": generated,
           "all_lengths_ok": generated == p.defaults_prompts * p.new_tokens,
           "tok_s": generated / generate_s,
           "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
           "model_dtype": str(llm.engine.model.dtype), "step_totals": totals,
           "kv_memory": stats.get("kv_memory"),
           "num_compiles_after_warmup": stats.get("num_compiles_after_warmup")}
    del llm
    gc.collect()
    return res
