"""The engine's ragged step compiled for an H200 without a GPU, and its compiled-program report.

`step_report(StepSpec(...))` builds the step the engine runs on a GPU (the runner's own jitted
step with Pallas attention and linears) for an abstract model (`jax.ShapeDtypeStruct` params:
an 8B shape costs no memory), compiles it deviceless (jaxserve/tools/deviceless.py) and reads
the program (jaxserve/tools/compiled_report.py). A decode step is the token bucket of
`max_num_seqs` tokens; the mixed step is the `max_num_batched_tokens` bucket (decodes and
prefill chunks share one program per bucket, whatever the mix). Each report carries the
performance model's prediction of the step on an H200 (jaxserve/tools/perf_model.py) for live
rows of `context_len` tokens of context each.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.kv_cache import KVCache
from jaxserve.runtime.runner import ModelRunner
from jaxserve.runtime.runner_factory import build_runner
from jaxserve.runtime.runner_spec import LoRASlots, RunnerSpec, StepProgram
from jaxserve.tools import compiled_report, deviceless, perf_model, thunks
from jaxserve.tools.hlo_costs import HloModule, type_bytes
from jaxserve.tools.hlo_text import Module, array_type
from models.config import ModelConfig
from models import lora as lora_slots
from models.llama import Llama
from models.model import Model

STEP_MODULE = "jit__step_impl"  # the runner's jitted step, as XLA names its dump files


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
    """One compile: model shape and weights, batch shape, and how the step program is built."""

    config: ModelConfig
    weights: Literal["bf16", "int4"] = "bf16"
    tokens: int = 64                 # the token bucket (64: a batch-64 decode step)
    max_num_seqs: int = 64
    max_model_len: int = 2048
    block_size: int = 16
    unroll_layers: bool = True       # the GPU default (ModelRunner.unroll_layers)
    branch_free_sampling: bool = True  # the GPU default (ModelRunner.branch_free_sampling)
    # The GPU default: the branch-free sampler's kernel ("pallas"); "xla": its XLA form.
    sampler_backend: Literal["xla", "pallas"] = "pallas"
    # The attention, int4 and MoE kernels' Pallas backend: an H200's default
    # (gpu_kernels="auto" on compute capability 9.0) is Mosaic GPU; "triton" is what older
    # GPUs run.
    gpu_kernels: Literal["mosaic", "triton"] = "mosaic"
    # The GPU default: decode-sized steps run each block's linears with their norms, SiLU and
    # residual adds in the fused-linear kernel (bf16 weights; int4 keeps its own kernel).
    fused_linears: bool = True
    compiler_options: tuple = ()     # extra XLA options, as (name, value) pairs
    lora: LoRASlots | None = None    # adapter slots: every adapted linear runs the LoRA kernel
    context_len: int = 1024          # the performance model's context per live row
    # The KV cache: bf16, or int8 codes with f32 scales per (token, KV head).
    kv_cache_dtype: Literal["bfloat16", "int8"] = "bfloat16"

    def __post_init__(self):
        if self.gpu_kernels not in ("mosaic", "triton"):
            raise ValueError(f"gpu_kernels must be 'mosaic' or 'triton', got "
                             f"{self.gpu_kernels!r}")
        if self.kv_cache_dtype not in ("bfloat16", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'bfloat16' or 'int8', got "
                             f"{self.kv_cache_dtype!r}")
        if self.weights not in ("bf16", "int4"):
            raise ValueError(f"weights must be 'bf16' or 'int4', got {self.weights!r}")
        if self.tokens < 1 or self.tokens > self.max_model_len * self.max_num_seqs:
            raise ValueError(f"tokens must be in [1, max_num_seqs * max_model_len], got "
                             f"{self.tokens}")
        if not 1 <= self.context_len <= self.max_model_len:
            raise ValueError(f"context_len must be in [1, max_model_len={self.max_model_len}], "
                             f"got {self.context_len}")

    @property
    def live_rows(self) -> int:
        """Sequences the step serves: a decode bucket's tokens, at most max_num_seqs."""
        return min(self.tokens, self.max_num_seqs)


def abstract_params(config: ModelConfig, weights: str):
    """The model's params as ShapeDtypeStructs (bf16, or int4 as the engine quantizes them)."""
    module = Llama(config, dtype=jnp.bfloat16)
    tokens = jnp.zeros((1, 1), jnp.int32)  # [B, T]
    params = jax.eval_shape(lambda k: module.init(k, tokens, tokens)["params"],
                            jax.random.key(0))
    if weights == "int4":
        from jaxserve.quantization import quantize_params_int4
        params = jax.eval_shape(quantize_params_int4, params)
    return params


def _runner(spec: StepSpec, params) -> ModelRunner:
    # Two KV blocks: the runner's own cache is never used, the compile takes an abstract one.
    # The program is the GPU's, spelled out: this machine's "auto" would resolve to its own.
    model = Model(config=spec.config, params=params, tokenizer=None, dtype="bfloat16",
                  source="abstract")
    return build_runner(model, RunnerSpec(
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=max(spec.tokens, spec.max_num_seqs),
        block_size=spec.block_size, num_blocks=2, max_model_len=spec.max_model_len,
        program=StepProgram(attention_backend="pallas", linear_backend="pallas",
                            gpu_kernels=spec.gpu_kernels,
                            unroll_layers=spec.unroll_layers,
                            branch_free_sampling=spec.branch_free_sampling,
                            sampler_backend=(spec.sampler_backend if spec.branch_free_sampling
                                             else "xla"),
                            fused_linears=spec.fused_linears and spec.unroll_layers,
                            lora=spec.lora, kv_cache_dtype=spec.kv_cache_dtype)))


def expected_experts(config: ModelConfig, rows: int) -> float:
    """Distinct experts a decode step of `rows` tokens reaches, expected under uniform routing
    (each token picks k of E without repeats: an expert escapes a token with probability
    1 - k / E): E (1 - (1 - k / E)^rows). 0 for a dense model."""
    e, k = config.num_experts, config.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** rows) if e else 0.0


def weight_bytes(params, config: ModelConfig, rows: int | None = None) -> int:
    """Bytes of the weights one decode step must read, as stored (int4 codes packed two to a
    byte): all of them, less an untied input embedding, of which a step gathers its rows; of
    a MoE model's stacked experts (`params["layers"]`'s `[L, E, ...]` gate/up/down) the share
    of `rows` tokens' `expected_experts` (None: all experts)."""
    def size(tree):
        return sum(type_bytes(array_type(x.dtype, x.shape)) for x in jax.tree.leaves(tree))

    total = size(params)
    if not config.tie_word_embeddings:
        total -= size(params["embedding"])
    if config.num_experts and rows is not None:
        experts = sum(size(params["layers"]["mlp"][n]) for n in ("gate", "up", "down"))
        total -= round(experts * (1 - expected_experts(config, rows) / config.num_experts))
    return total


def step_report(spec: StepSpec) -> tuple[compiled_report.StepReport, dict]:
    """(report, extras: compile seconds, ptxas note, the performance model's kernel costs and
    H200 prediction) of the engine's step for `spec`."""
    params = abstract_params(spec.config, spec.weights)
    runner = _runner(spec, params)
    c = spec.config
    # Room for every slot's full context, plus the null block.
    num_blocks = spec.max_num_seqs * -(-spec.max_model_len // spec.block_size) + 1
    shape = (c.num_layers, num_blocks, spec.block_size, c.num_kv_heads, c.head_dim)
    if spec.kv_cache_dtype == "int8":
        codes = jax.ShapeDtypeStruct(shape, jnp.int8)  # [L, N, bs, K, Dh]
        scales = jax.ShapeDtypeStruct(shape[:-1], jnp.float32)  # [L, N, bs, K]
        kv = KVCache(k=codes, v=codes, k_scale=scales, v_scale=scales)
    else:
        cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # [L, N, bs, K, Dh]
        kv = KVCache(k=cache, v=cache)
    cache_bytes = sum(type_bytes(array_type(x.dtype, x.shape)) for x in jax.tree.leaves(kv))
    inputs = runner.step_template(spec.tokens).inputs
    # The runner's params: per-layer trees when it unrolls the layers (unstack_layers).
    args = (runner.model.params, kv, runner.state, inputs)
    with tempfile.TemporaryDirectory(prefix="jaxserve-step-") as dump:
        out = deviceless.compile_for_h200(runner.step_function, args, dump_dir=dump,
                                          donate_argnums=(1, 2),
                                          compiler_options=dict(spec.compiler_options))
        tree, hlo = thunks.load_dump(dump, STEP_MODULE)
    costs = perf_model.costs_of(tree, HloModule.parse(hlo), context_len=spec.context_len,
                                rows=spec.live_rows)
    weights = weight_bytes(params, c, spec.live_rows)
    prediction = perf_model.predict(costs, perf_model.H200, tokens=spec.live_rows,
                                    weight_bytes=weights)
    stacked = {array_type(x.dtype, x.shape) for x in jax.tree.leaves(params["layers"])}
    report = compiled_report.analyse(
        tree, Module.parse(hlo), num_layers=c.num_layers, stacked=stacked,
        memory=out.compiled.memory_analysis(), cache_bytes=cache_bytes,
        ptxas_log=out.ptxas_log)
    lora_bytes = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
                     for pair in lora_slots.slot_leaves(runner.model.params,
                                                        c.num_layers).values() for x in pair)
    return report, {"compile_s": out.compile_s, "ptxas_note": out.ptxas_note,
                    "lora_slot_bytes": lora_bytes, "weight_bytes": weights,
                    "kernel_costs": costs, "prediction": prediction}


def model_shapes() -> dict[str, ModelConfig]:
    """The shapes the report covers: SmolLM2-135M, Llama-3.2-1B, a Llama-3-8B-shaped model
    and OLMoE-1B-7B's (64 experts, top-8: the MoE grouped matmul)."""
    from models.config import RopeScaling
    return {
        "smollm2": ModelConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
            eos_token_ids=(2,)),
        "llama3.2-1b": ModelConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
            num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192),
            max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009)),
        "llama3-8b": ModelConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192),
            max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128009,)),
        "olmoe-1b-7b": ModelConfig(
            vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_layers=16,
            num_heads=16, num_kv_heads=16, head_dim=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=4096, qk_norm="full",
            architecture="olmoe", num_experts=64, num_experts_per_tok=8,
            moe_intermediate_size=1024, bos_token_id=None, eos_token_ids=(50279,))}
