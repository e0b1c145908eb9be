"""What an LLMEngine is built from: the model prepared for its backends (quantized, sharded,
layers stacked or unrolled), the KV-cache plan, the scheduler that plan sizes, and the runner
(runtime/runner_factory.py, from the RunnerSpec this derives from the config).

Kept apart from engine.py, whose subject is the request loop: this runs once, at construction.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.quantization.paths import prepare_model
from jaxserve.runtime import backends, multihost, sharding
from jaxserve.runtime.kv_cache import log_plan, plan_num_blocks
from jaxserve.runtime.runner import ModelRunner
from jaxserve.runtime.runner_factory import build_runner, prepare_weights
from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram
from models import Model, load_model

CPU_KV_CACHE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class EngineParts:
    model: Model        # as the runner holds it (with tensor parallel: the placed shards)
    quantization: object  # prepare_model's description of the weights' quantization, or None
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    eos_ids: set[int]


def _memory_stats() -> dict:
    return jax.local_devices()[0].memory_stats() or {}  # this process's (multi-host)


def _kv_budget(config: EngineConfig, model: Model) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    stats = _memory_stats()
    if "bytes_limit" in stats:  # accelerators report their memory; the CPU does not
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * config.gpu_memory_utilization)
    return CPU_KV_CACHE_BYTES


def build(config: EngineConfig, model: Model | None, faults) -> EngineParts:
    """model: already loaded, else loaded from config.model. faults: the engine's fault
    injector (None but in tests)."""
    if model is None:
        model = load_model(config.model, backends.default_dtype(config.dtype),
                           weights_cache=config.weights_cache)
    # Tensor parallel: a mesh, and heads padded for it (float weights: before quantization).
    tp, model = sharding.setup(config.tensor_parallel_size, model)
    model, quantization = prepare_model(model, config.quantization,
                                        tensor_parallel_size=config.tensor_parallel_size)
    tok = model.tokenizer
    program = StepProgram.from_config(
        config, params=model.params, tensor_parallel=tp is not None, tokenizer=tok is not None,
        poison_rows=faults is not None and faults.config.poisons_logits,
        model_config=model.config)
    if program.lora is not None and jax.process_count() > 1:
        raise ValueError("enable_lora runs on one host; multi-host serving does not load "
                         "adapters yet")
    # Repacked and split before the KV plan, so that the copies they replace are freed by then.
    model = prepare_weights(model, program)
    mc, bs = model.config, config.block_size
    # The budget is one device's memory, so plan with the KV heads one device holds.
    plan_mc = sharding.per_device_config(mc, tp.size) if tp else mc
    kv_dtype = program.kv_dtype(model)
    num_blocks = plan_num_blocks(plan_mc, bs, kv_dtype, _kv_budget(config, model))
    if jax.process_count() > 1:  # one cache shape on every host: process 0's plan
        num_blocks = multihost.agree(num_blocks)
    capacity = max(0, num_blocks - 1) * bs
    max_len = config.max_model_len or min(mc.max_position_embeddings, capacity)
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's context length "
                         f"({mc.max_position_embeddings})")
    # Raises, with the numbers, when one max_model_len sequence cannot fit the cache.
    scheduler = Scheduler(config.scheduler_config(num_blocks=num_blocks, max_model_len=max_len))
    log_plan(plan_mc, bs, kv_dtype, num_blocks)
    eos_ids = set(tok.stop_token_ids) if tok is not None else set(mc.eos_token_ids)
    spec = RunnerSpec.from_config(config, num_blocks=num_blocks, max_model_len=max_len,
                                  eos_ids=eos_ids, program=program)
    runner = build_runner(model, spec, tp=tp, quantization=quantization)
    # With tensor parallel the runner holds the placed shards: no unsharded copy is kept.
    return EngineParts(model=runner.model, quantization=quantization, scheduler=scheduler,
                       runner=runner, max_model_len=max_len, eos_ids=eos_ids)
