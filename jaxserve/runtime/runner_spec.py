"""What a ModelRunner is built from: its shapes and the step program it compiles.

`StepProgram` holds the program choices (backends, layer loop, sampler shape, KV dtype, compiled
variants), every "auto" of `EngineConfig` resolved for this machine by `StepProgram.from_config`
and nowhere else. `RunnerSpec` adds the shapes (batch, token budget, KV blocks, context length,
stop ids). The two are separate because the engine needs the program before it knows the
shapes: the weights are repacked and split for the program first, so that the copies they
replace are freed before the KV plan measures free memory, and the plan gives `num_blocks`.

A target, a draft model, the GPU step report and the profiling scripts all build their runner
from a RunnerSpec through `runner_factory.build_runner`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, KVCacheDtype
from jaxserve.config_fields import check_choices
from jaxserve.core.block_manager import validate_block_size
from jaxserve.core.lora import LORA_TARGETS
from jaxserve.runtime import backends

# A backend as the step runs it: config.Backend without "auto".
ResolvedBackend = Literal["xla", "cpu", "pallas", "pallas-interpret"]
# EngineConfig.gpu_kernels resolved: the Pallas backend of the attention, int4 and MoE kernels.
GpuKernelsResolved = Literal["mosaic", "triton"]
# The sampler: XLA's (sampler.py), or the GPU step's kernel (sampler_kernel.py; interpreted).
SamplerBackend = Literal["xla", "pallas", "pallas-interpret"]

_FLAGS = ("attention_fallback", "gpu_kernels_fallback", "unroll_layers", "branch_free_sampling",
          "fused_linears", "fine_decode_buckets", "structured_outputs", "poison_rows", "pooling")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRASlots:
    """The device's LoRA adapter slots (models/lora.py): `max_loras` slots of rank `max_rank`
    for each of `targets`. Fixed for the runner's life: loading an adapter recompiles nothing."""

    max_loras: int
    max_rank: int
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        for name in ("max_loras", "max_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {LORA_TARGETS}, got "
                             f"{self.targets!r}")

    @classmethod
    def parse(cls, value) -> LoRASlots | None:
        """A LoRASlots from itself, None or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(f"LoRA slots must be a LoRASlots, a dict or None, got {value!r}")

    @classmethod
    def for_model(cls, config, model_config) -> LoRASlots:
        """EngineConfig's slots for a model: a MoE model's experts are not adapted."""
        targets = tuple(t for t in LORA_TARGETS if not (
            model_config is not None and model_config.num_experts
            and t in ("gate_proj", "up_proj", "down_proj")))
        return cls(max_loras=config.max_loras, max_rank=config.max_lora_rank, targets=targets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepProgram:
    """Which step program a runner compiles. The defaults are the plainest one (XLA attention
    and linears, a layer scan, no variants); `from_config` gives an engine's."""

    attention_backend: ResolvedBackend = "xla"
    # EngineConfig asked for "auto": XLA attention where the kernel cannot run the model
    # (backends.attention_backend), instead of an error.
    attention_fallback: bool = False
    linear_backend: ResolvedBackend = "xla"
    # Which Pallas backend the pallas* attention, int4 and MoE grouped matmul kernels lower
    # through (the other kernels are Triton's either way).
    gpu_kernels: GpuKernelsResolved = "triton"
    # EngineConfig asked for gpu_kernels "auto": the Triton attention kernel where the Mosaic
    # GPU one cannot run the model (backends.attention_backend), instead of an error.
    gpu_kernels_fallback: bool = False
    # One block per layer over per-layer weights (no weight slice copied per step), else a
    # lax.scan over the stacked weights (compile time flat in depth).
    unroll_layers: bool = False
    branch_free_sampling: bool = False   # a sampler without conditionals (the GPU's)
    # The branch-free sampler's filters, draw and top logprobs in one Pallas kernel (the GPU's).
    sampler_backend: SamplerBackend = "xla"
    # Decode-sized steps run each block's linears with its norms, SiLU and residual adds in
    # the Pallas fused-linear kernel (the GPU's; backends.fused_linear_backend says where).
    fused_linears: bool = False
    fine_decode_buckets: bool = False    # also the 3/4 decode token buckets (the CPU's)
    kv_cache_dtype: KVCacheDtype = "auto"  # "auto": the weights' dtype
    structured_outputs: bool = False     # a token-bitmask variant of every step program
    poison_rows: bool = False            # fault injection adds StepInputs.poison to logits
    pooling: bool = False                # a pooled variant of every program (embeddings)
    num_speculative_tokens: int = 0      # k > 0: a verification variant of every program
    lora: LoRASlots | None = None        # LoRA adapter slots in the params, and their index

    def __post_init__(self):
        for name in ("attention_backend", "linear_backend"):
            if getattr(self, name) == "auto":
                raise ValueError(f"{name} must be resolved for this machine, got 'auto'; build "
                                 "the program with StepProgram.from_config(config)")
        check_choices(self)  # the backends and kv_cache_dtype
        if self.gpu_kernels == "mosaic" and not self.unroll_layers and "pallas-interpret" in (
                self.attention_backend, self.linear_backend):
            # JAX's GPU interpret mode inside flax's layer scan fails in tracing ("broadcasted
            # variable has a data dependency on the scan body"); compiled, the scan is fine.
            raise ValueError("the Mosaic GPU kernels run interpreted in the unrolled (GPU) "
                             "layer loop only: set layer_loop='unrolled', or "
                             "gpu_kernels='triton'")
        if self.fused_linears and self.linear_backend not in ("pallas", "pallas-interpret"):
            raise ValueError("fused_linears runs the Pallas fused-linear kernel: set "
                             "linear_backend to 'pallas' (or 'pallas-interpret' on CPU)")
        if self.sampler_backend != "xla" and not self.branch_free_sampling:
            raise ValueError(f"sampler_backend={self.sampler_backend!r} is the branch-free "
                             "sampler's kernel: set branch_free_sampling=True, or use "
                             "sampler_backend='xla'")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0 (0: no "
                             f"speculative decoding), got {k!r}")
        if self.lora is not None and not isinstance(self.lora, LoRASlots):
            raise ValueError(f"lora must be a LoRASlots or None, got {self.lora!r}")

    @classmethod
    def from_config(cls, config: EngineConfig, *, params=None, tensor_parallel: bool = False,
                    tokenizer: bool = True, poison_rows: bool = False,
                    draft: bool = False, model_config=None) -> StepProgram:
        """The program `config` asks for on this machine. params: the model's weights as
        quantized, before `runner_factory.prepare_weights` (whether the CPU's native matmul
        will repack them picks the layer loop). tokenizer: whether the model has one
        (structured outputs need it). poison_rows: the engine's fault injector poisons logits.
        draft: a draft model's program, the target's choices without structured outputs or
        verification (or adapters). model_config: the model's (its LoRA targets; needed with
        enable_lora)."""
        linear = backends.resolve(config.linear_backend)
        if tensor_parallel and linear == "cpu":
            linear = "xla"  # the native kernel reads whole, repacked weights
        spec = config.speculative_config
        return cls(
            attention_backend=backends.resolve(config.attention_backend, attention=True),
            attention_fallback=config.attention_backend == "auto",
            linear_backend=linear,
            gpu_kernels=backends.gpu_kernels(config.gpu_kernels),
            gpu_kernels_fallback=config.gpu_kernels == "auto",
            unroll_layers=backends.unroll_layers(config.layer_loop, tensor_parallel,
                                                 params=params, linear_kind=linear),
            branch_free_sampling=backends.gpu_step(),
            sampler_backend=backends.sampler_backend(),
            fused_linears=(config.fused_linears and backends.gpu_step()
                           and linear in ("pallas", "pallas-interpret")),
            fine_decode_buckets=backends.fine_decode_buckets(),
            kv_cache_dtype=config.kv_cache_dtype,
            structured_outputs=config.structured_outputs and tokenizer and not draft,
            poison_rows=poison_rows,
            pooling=config.enable_embeddings and not draft,
            num_speculative_tokens=0 if draft or spec is None else spec.num_speculative_tokens,
            lora=(LoRASlots.for_model(config, model_config)
                  if config.enable_lora and not draft else None))

    def kv_dtype(self, model) -> np.dtype:
        """The KV cache's element type for `model` (int8: codes, with scales beside them)."""
        if self.kv_cache_dtype == "auto":
            return np.dtype(model.params["embedding"].dtype)
        return np.dtype(jnp.dtype(self.kv_cache_dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerSpec:
    """A runner's shapes and program. Every shape is fixed for the runner's life: each step
    is padded to them, so they decide the compiled programs."""

    max_num_seqs: int            # batch slots
    max_num_batched_tokens: int  # tokens per step
    block_size: int              # tokens per KV block
    num_blocks: int              # KV blocks in the cache, the null block 0 included
    max_model_len: int           # longest sequence: the page table's and history's width
    eos_ids: tuple[int, ...] = ()  # the slots' stop ids (sampling parameters may add more)
    program: StepProgram = StepProgram()

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        validate_block_size(self.block_size)
        n = self.num_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block "
                             f"padding reads and writes), got {n!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): a step decodes every slot at once")
        ids = self.eos_ids
        if not isinstance(ids, (str, bytes)) and hasattr(ids, "__iter__"):
            ids = tuple(ids)  # a list is taken as given
        if not isinstance(ids, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"eos_ids must be token ids (integers >= 0), got {self.eos_ids!r}")
        object.__setattr__(self, "eos_ids", ids)
        if not isinstance(self.program, StepProgram):
            raise ValueError(f"program must be a StepProgram, got {self.program!r}")

    @classmethod
    def from_config(cls, config: EngineConfig, *, num_blocks: int, max_model_len: int,
                    eos_ids=(), program: StepProgram | None = None) -> RunnerSpec:
        """`config`'s shapes with the engine's KV plan (num_blocks, max_model_len) and the
        model's stop ids. program: None is StepProgram.from_config(config) (one device, no
        weights to repack, no fault injection)."""
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   block_size=config.block_size, num_blocks=num_blocks,
                   max_model_len=max_model_len, eos_ids=tuple(sorted(eos_ids)),
                   program=StepProgram.from_config(config) if program is None else program)
