"""The one way to build a ModelRunner: `build_runner(model, spec)`.

It prepares what the runner's step reads, as the spec's program says: the weights (repacked
for the native CPU matmul, layers split when unrolled) and the backend objects (attention,
linears, the tied LM head, the MoE experts' grouped matmul, each wrapped for tensor parallelism
where it runs per shard). The engine, a draft model, the GPU step report and the profiling
scripts all build their runner here, so that the same spec gives the same program everywhere.
"""

from __future__ import annotations

import dataclasses

from jaxserve.quantization.paths import activation_bits
from jaxserve.runtime import backends
from jaxserve.runtime.attention_backends import AttentionBackend
from jaxserve.runtime.grouped_matmul import grouped_matmul_backend
from jaxserve.runtime.runner import ModelRunner
from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram
from jaxserve.runtime.sharding import TensorParallel
from models import lora
from models.layer_layout import unstack_layers
from models.model import Model
from models.quantized import CpuPackedWeight


def prepare_weights(model: Model, program: StepProgram) -> Model:
    """`model` with its params as `program`'s step reads them: quantized weights repacked for
    the native CPU matmul (linear backend "cpu"), then, with unrolled layers, the stacked
    layers split into per-layer trees (each array copied once). Params already prepared are
    kept as they are: the engine prepares them before its KV plan, so that the plan sees the
    replaced copies freed, and build_runner's own call then costs nothing."""
    model = backends.prepare_params(program.linear_backend, model)
    slots = program.lora
    if slots is not None and not lora.slot_leaves(model.params, model.config.num_layers):
        # Zeroed adapter slots beside the kernels they adapt (models/lora.py), stacked [L, ..]
        # like the layers, so that unrolling splits them too.
        arrays = lora.slot_arrays(model.config, slots.targets, slots.max_loras, slots.max_rank,
                                  model.params["embedding"].dtype)
        model = dataclasses.replace(model, params=lora.with_slots(model.params, arrays))
    if program.unroll_layers:
        keep = stays_stacked if backends.has_packed(model.params) else None
        model = dataclasses.replace(model, params=unstack_layers(
            model.params, model.config.num_layers, keep))
    return model


def stays_stacked(path: tuple, leaf) -> bool:
    """The layer leaves an unrolled CPU step reads from their `[L, ...]` stack (models/llama.py
    layer_views): the native matmul's packed weights, which it reads in place at the layer's
    offset, and the norms' scales and biases, which the fusions that use them slice in place.
    Each would otherwise be a buffer per layer handed to every step call, at ~2.5 us of the
    dispatch's CPU time each (SmolLM2: 711 buffers a call unstacked, 44 so)."""
    return isinstance(leaf, CpuPackedWeight) or (
        getattr(leaf, "ndim", 0) == 2 and path[-1] in ("scale", "bias"))


def build_runner(model: Model, spec: RunnerSpec, *, tp: TensorParallel | None = None,
                 quantization: str | None = None,
                 attention: AttentionBackend | None = None) -> ModelRunner:
    """The runner for `spec`. model: as loaded and quantized (with tensor parallelism: heads
    padded for `tp`, not yet placed; the runner places them). quantization: the path
    `prepare_model` serves, whose activation bits pick the linears'. attention: an object to
    run instead of the spec's backend (the profiling scripts' stubs, tests)."""
    program = spec.program
    if program.unroll_layers and tp is not None:
        raise ValueError("unroll_layers runs on one device; tensor parallel keeps the layer "
                         "loop")
    model = prepare_weights(model, program)
    kind, mc = program.linear_backend, model.config
    if attention is None:
        attention = backends.attention_backend(
            program.attention_backend, mc, spec.block_size,
            "auto" if program.attention_fallback else program.attention_backend,
            gpu_kernels=program.gpu_kernels, kv_dtype=program.kv_dtype(model).name,
            model_dtype=str(model.params["embedding"].dtype),
            gpu_kernels_fallback=program.gpu_kernels_fallback)
    linear = backends.linear_backend(kind, activation_bits(quantization), program.gpu_kernels)
    # The MoE experts follow the linear backend: the Pallas kernel on GPU, XLA on CPU.
    gmm = grouped_matmul_backend(kind, program.gpu_kernels) if mc.num_experts else None
    if tp is not None and kind != "xla":  # the kernels run per shard
        linear = tp.linear(linear)
        gmm = tp.grouped_matmul(gmm) if gmm is not None else None
    lora_backend = None  # the XLA path (models/lora.py), which XLA partitions under tp
    if program.lora is not None and kind in ("pallas", "pallas-interpret") and tp is None:
        from jaxserve.runtime.lora import kernel_lora_backend
        lora_backend = kernel_lora_backend(interpret=kind == "pallas-interpret")
    return ModelRunner(model, spec, attention=attention, linear=linear,
                       head=backends.head_backend(kind), grouped_matmul=gmm, tp=tp,
                       lora_backend=lora_backend,
                       fused_linear=backends.fused_linear_backend(program, model)
                       if tp is None else None)
