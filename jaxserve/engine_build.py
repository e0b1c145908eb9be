"""What an LLMEngine is built from: the model prepared for its backends (quantized, sharded,
layers stacked or unrolled), the KV-cache plan, the scheduler that plan sizes, and the runner.

Kept apart from engine.py, whose subject is the request loop: this runs once, at construction.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.quantization.paths import activation_bits, prepare_model
from jaxserve.runtime import backends, multihost, sharding
from jaxserve.runtime.grouped_matmul import grouped_matmul_backend
from jaxserve.runtime.kv_cache import log_plan, plan_num_blocks
from jaxserve.runtime.runner import ModelRunner
from models import Model, load_model
from models.llama import unstack_layers

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


def spec_decode_tokens(config: EngineConfig) -> int:
    """k: drafted tokens per verified row (0: no speculative decoding)."""
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def build(config: EngineConfig, model: Model | None, faults) -> EngineParts:
    """model: already loaded, else loaded from config.model. faults: the engine's fault
    injector (None but in tests)."""
    if model is None:
        model = load_model(config.model, backends.default_dtype(config.dtype),
                           weights_cache=config.weights_cache)
    # Tensor parallel: a mesh, and heads padded for it (float weights: before quantization).
    tp, model = sharding.setup(config.tensor_parallel_size, model)
    model, quantization = prepare_model(model, config.quantization)
    linear_kind = backends.resolve(config.linear_backend)
    if tp is not None and linear_kind == "cpu":
        linear_kind = "xla"  # the native kernel reads whole, repacked weights
    model = backends.prepare_params(linear_kind, model)
    unroll = backends.unroll_layers(config.layer_loop, tensor_parallel=tp is not None,
                                    params=model.params)
    if unroll:  # split before the KV plan, so that the stacked copy is freed by then
        model = dataclasses.replace(model, params=unstack_layers(model.params,
                                                                 model.config.num_layers))
    mc, bs = model.config, config.block_size
    # The budget is one device's memory, so plan with the KV heads one device holds.
    plan_mc = sharding.per_device_config(mc, tp.size) if tp else mc
    kv_dtype = np.dtype(model.params["embedding"].dtype if config.kv_cache_dtype == "auto"
                        else jnp.dtype(config.kv_cache_dtype))
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
    tok = model.tokenizer
    eos_ids = set(tok.stop_token_ids) if tok is not None else set(mc.eos_token_ids)
    linear = backends.linear_backend(linear_kind, activation_bits(quantization))
    if tp is not None and linear_kind != "xla":  # the int4 kernel runs per shard
        linear = tp.linear(linear)
    # The MoE experts follow the linear backend: the Pallas kernel on GPU, XLA on CPU.
    gmm = grouped_matmul_backend(linear_kind) if mc.num_experts else None
    if gmm is not None and tp is not None and linear_kind != "xla":  # kernel: per shard
        gmm = tp.grouped_matmul(gmm)
    runner = ModelRunner(
        model, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, block_size=bs,
        num_blocks=num_blocks, max_model_len=max_len, eos_ids=sorted(eos_ids),
        attention=backends.attention_backend(
            backends.resolve(config.attention_backend, attention=True), mc, bs,
            config.attention_backend),
        linear=linear, tp=tp, kv_cache_dtype=kv_dtype,
        structured_outputs=config.structured_outputs and tok is not None,
        # Unrolled layers need the weights whole on one device: tensor parallel keeps the loop.
        unroll_layers=unroll,
        branch_free_sampling=backends.gpu_step(),
        fine_decode_buckets=backends.fine_decode_buckets(),
        poison_rows=faults is not None and faults.config.poisons_logits,
        num_speculative_tokens=spec_decode_tokens(config), grouped_matmul=gmm,
        head=backends.head_backend(linear_kind))
    # With tensor parallel the runner holds the placed shards: no unsharded copy is kept.
    return EngineParts(model=runner.model, quantization=quantization, scheduler=scheduler,
                       runner=runner, max_model_len=max_len, eos_ids=eos_ids)
