"""Attention and linear backends: which implementation runs inside the jitted step.

`xla` is pure jax.numpy and runs everywhere (the oracle, and the CPU fallback); `cpu` is the
native CPU kernels (jaxserve/native: the paged attention, and the int4 / int8 matmul on weights
repacked at load); `pallas` runs the Pallas kernels (GPU); `pallas-interpret` runs the same
kernels through the Pallas interpreter on CPU, for tests. `auto` picks pallas on GPU; on CPU,
cpu where the native library builds (for linears: with the AVX-512 VNNI loop) and xla otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax

from jaxserve import native
from jaxserve.runtime.attention_backends import (AttentionBackend, CpuAttention, PallasAttention,
                                                 XlaAttention)
from jaxserve.config import BACKENDS, GPU_KERNELS
from jaxserve.native import float_matmul
from jaxserve.native.quant_matmul import simd
from jaxserve.quantization.cpu_packed import pack_params, repacks
from jaxserve.quantization.gpu_format import gpu_params
from jaxserve.quantization.linear import ACTIVATION_BITS, quantized_linear
from models.config import ModelConfig
from models.fused import fusable
from models.llama import Parallel, dense_linear, tied_head
from models.quantized import CpuPackedWeight, Int4Weight, Int8Weight, is_quantized

log = logging.getLogger("jaxserve")

# Rows (tokens in a step) up to which a float weight runs the native matmul on kind "cpu",
# per weight dtype; XLA's dot above (measured: docs/performance.md, "Linears on CPU").
# XLA's float32 GEMM repacks the weight every call; its bfloat16 dot from two rows is an AMX
# product that beats a float32 FMA loop, so bfloat16 hands over early.
NATIVE_FLOAT_ROWS = {"float32": 16, "bfloat16": 4}


def resolve(kind: str, attention: bool = False) -> str:
    """The backend `kind` means here: `auto` resolved for this platform (and, for attention,
    whether the native CPU library is available)."""
    if kind not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {kind!r}")
    what = "attention" if attention else "quantized matmul"
    if kind == "cpu":
        why = native.unavailable_reason()
        if why is not None:
            raise ValueError(f"the native CPU {what} is unavailable here ({why}); use 'xla'")
    if kind == "auto":
        if jax.default_backend() == "gpu":
            return "pallas"
        if jax.default_backend() == "cpu":
            why = native.unavailable_reason()
            if why is None and not attention and not simd():
                # The portable loop is correct but slower than XLA's dots.
                why = "this CPU has neither AVX-512 VNNI nor AVX2"
            if why is None:
                return "cpu"
            log.warning("native CPU %s unavailable (%s): using XLA", what, why)
        return "xla"
    return kind


# Mosaic GPU kernels use TMA and wgmma: Hopper (sm_90) and later.
MOSAIC_MIN_CAPABILITY = (9, 0)


def gpu_kernels(requested: str, device=None) -> str:
    """EngineConfig.gpu_kernels resolved for `device` (default: jax's first): "mosaic" or
    "triton". auto: Mosaic GPU on a CUDA device of compute capability >= 9.0, Triton on older
    ones (Ampere, Ada), on other platforms, and where the kernels are interpreted on CPU (the
    Triton interpreter is the older, faster one; tests ask for "mosaic" by name)."""
    if requested not in GPU_KERNELS:
        raise ValueError(f"gpu_kernels must be one of {GPU_KERNELS}, got {requested!r}")
    if requested != "auto":
        return requested
    device = device if device is not None else jax.devices()[0]
    capability = getattr(device, "compute_capability", None)  # "9.0" on a CUDA device
    if device.platform != "gpu" or not capability:
        return "triton"
    major, _, minor = str(capability).partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):  # e.g. ROCm's "gfx90a"
        return "triton"
    found = (int(major), int(minor or 0))
    return "mosaic" if found >= MOSAIC_MIN_CAPABILITY else "triton"


def prepare_params(kind: str, model):
    """The model with its quantized linear weights in the layout the `kind` linear backend
    reads: repacked once, at load, for the native CPU kernel (never per step); int4 scales
    and offsets in bfloat16 for the Pallas kernel (quantization/gpu_format.py); as is
    otherwise. (Tensor parallelism shards the stored types: the engine gives it kind xla.)"""
    if kind == "cpu":
        return dataclasses.replace(model, params=pack_params(model.params))
    if kind in ("pallas", "pallas-interpret"):
        return dataclasses.replace(model, params=gpu_params(model.params))
    return model


def default_dtype(requested: str | None) -> str:
    """The model dtype for EngineConfig.dtype: bfloat16 on GPU, float32 elsewhere (None)."""
    if requested is not None:
        return requested
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def unroll_layers(layer_loop: str, tensor_parallel: bool, params=None,
                  linear_kind: str | None = None) -> bool:
    """EngineConfig.layer_loop resolved: unrolled on GPU by default, and on CPU where `params`
    hold weights repacked for the native quantized matmul, or will once prepared for the
    `linear_kind` backend (a scan would hand the FFI call each layer's slice of the stacked
    weights as a fresh copy, every step). Float weights keep the scan on CPU: unrolled, a
    float32 SmolLM2 decodes ~1.5x faster at batch 1 but its warm start doubles
    (docs/performance.md), so that is `layer_loop="unrolled"`'s choice to make. Never with
    tensor parallelism (the unrolled step needs each weight whole on one device)."""
    if tensor_parallel:
        if layer_loop == "unrolled":
            raise ValueError("layer_loop='unrolled' runs on one device; with tensor_parallel_size "
                             "> 1 use 'scan' or 'auto'")
        return False
    return layer_loop == "unrolled" or (layer_loop == "auto" and (
        gpu_step() or (params is not None and has_packed(params, linear_kind))))


def native_float(kind: str) -> bool:
    """Whether the `kind` linear backend runs float weights on the native matmul at few rows
    (NATIVE_FLOAT_ROWS): kind "cpu" where the library has its AVX-512 loops (the portable
    one is slower than XLA's dot)."""
    return kind == "cpu" and native.unavailable_reason() is None and float_matmul.avx512()


def _native_rows(x, w) -> bool:
    """Whether x @ w (w a float kernel) takes the native float matmul: few rows, a 2-D weight
    of a dtype it reads."""
    rows = NATIVE_FLOAT_ROWS.get(jax.numpy.dtype(w.dtype).name)
    return rows is not None and w.ndim == 2 and math.prod(x.shape[:-1]) <= rows


def has_packed(params, kind: str | None = None) -> bool:
    """Whether `params` hold any weight repacked for the native CPU matmul, or will once
    prepared for the `kind` linear backend (`prepare_params`): known before repacking, so that
    the layer loop is chosen before the weights are prepared for it."""
    types = (CpuPackedWeight, Int4Weight, Int8Weight)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, types))
    return any(isinstance(w, CpuPackedWeight) or (kind == "cpu" and repacks(w))
               for w in leaves)


def gpu_step() -> bool:
    """Whether the step takes its GPU shape: layers unrolled and a branch-free sampler
    (ModelRunner's unroll_layers and branch_free_sampling; docs/gpu_step_report.md)."""
    return jax.default_backend() == "gpu"


def sampler_backend() -> str:
    """StepProgram.sampler_backend: the GPU step samples with the Pallas kernel
    (runtime/sampler_kernel.py), interpreted where jax runs on CPU (a GPU-shaped step there, as
    tests make one); the CPU step keeps XLA's conditional sampler."""
    if not gpu_step():
        return "xla"
    return "pallas" if jax.default_backend() == "gpu" else "pallas-interpret"


def fine_decode_buckets() -> bool:
    """Whether decode steps get 3/4 token buckets too (step_layout.token_buckets): on CPU a
    step's linears, LM head and sampler cost grows with its padded rows (48 rows ran at 64);
    on GPU a decode step's cost is nearly flat in its rows, so extra programs buy nothing."""
    return jax.default_backend() == "cpu"


def attention_backend(kind: str, config: ModelConfig, block_size: int,
                      requested: str, gpu_kernels: str = "triton",
                      kv_dtype: str = "bfloat16", model_dtype: str = "bfloat16",
                      gpu_kernels_fallback: bool = False) -> AttentionBackend:
    """The attention backend for `kind` (resolved); falls back to XLA where the kernel cannot
    run. gpu_kernels, kv_dtype, model_dtype: the Pallas kernel's backend
    (StepProgram.gpu_kernels), the cache's element type it will read and the model's;
    gpu_kernels_fallback: the Triton kernel where the Mosaic GPU one cannot run (gpu_kernels
    "auto"), before any fallback to XLA."""
    if kind == "xla":
        return XlaAttention()
    backend = (CpuAttention() if kind == "cpu"
               else PallasAttention(interpret=kind == "pallas-interpret", kernels=gpu_kernels,
                                    kv_dtype=kv_dtype, model_dtype=model_dtype))
    unsupported = backend.supports(config, block_size)
    if unsupported and isinstance(backend, PallasAttention) and backend.kernels == "mosaic" \
            and gpu_kernels_fallback:
        log.info("%s: using the Triton attention kernel", "; ".join(unsupported))
        backend = dataclasses.replace(backend, kernels="triton")
        unsupported = backend.supports(config, block_size)
    if unsupported:
        if requested != "auto":
            raise ValueError(f"attention_backend={requested!r} cannot run {', '.join(unsupported)}"
                             "; use attention_backend='xla'")
        log.info("%s attention unsupported for %s: using XLA attention", backend.name,
                 list(unsupported))
        return XlaAttention()
    return backend


def linear_backend(kind: str, activation_bits: int = 16, gpu_kernels: str = "triton"):
    """`linear(x, w, parallel)`: x @ w, w a float kernel or a quantized one (models/quantized.py).

    Int4Weight runs the Pallas kernel (pallas*) or the XLA reference; Int8Weight runs integer
    dots in XLA, with int8 activations when `activation_bits` is 8 (W8A8); CpuPackedWeight
    (`prepare_params` for `cpu`) runs the native kernel; a float32 / bfloat16 kernel runs the
    native float matmul at up to NATIVE_FLOAT_ROWS rows on `cpu` (the step's static row
    count), XLA's dot otherwise. gpu_kernels: the int4 kernel's Pallas backend on pallas*
    (StepProgram.gpu_kernels). `parallel`, the layer's declared
    role, is for the tensor-parallel wrapper (TensorParallel.linear).
    """
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS}, got "
                         f"{activation_bits!r}")

    native_rows = native_float(kind)

    def linear(x, w, parallel: Parallel = None):
        if not is_quantized(w):
            if native_rows and _native_rows(x, w):
                return float_matmul.float_matmul_cpu(x, w)
            return dense_linear(x, w, parallel)
        # The XLA and Pallas linears see kind "xla" for what the native kernel does not take.
        return quantized_linear(x, w, "xla" if kind == "cpu" else kind, activation_bits,
                                gpu_kernels=gpu_kernels)

    return linear


@dataclasses.dataclass(frozen=True)
class PallasFusedLinear:
    """models/fused.py's FusedLinearFn on pallas_kernels/fused_linear.py (interpreted on CPU
    for tests)."""

    interpret: bool = False

    @property
    def max_rows(self) -> int:
        from pallas_kernels.fused_linear import MAX_ROWS
        return MAX_ROWS

    @property
    def tile(self) -> int:
        from pallas_kernels.gpu_tiling import MIN_DOT_ROWS
        return MIN_DOT_ROWS  # the kernel's narrowest column tile (Triton's smallest dot)

    def __call__(self, x, weights, norm_scale=None, biases=None, residual=None,
                 positions=None, inv_freq=None, x_rows=None, *, eps: float = 1e-6,
                 activation: str | None = None, rope_weights: int = 0,
                 rope_scale: float = 1.0, transposed: bool = False, out_dtype=None):
        from pallas_kernels.fused_linear import fused_linear
        return fused_linear(x, weights, norm_scale, biases, residual, positions, inv_freq,
                            x_rows, eps=eps, activation=activation, rope_weights=rope_weights,
                            rope_scale=rope_scale, transposed=transposed, out_dtype=out_dtype,
                            interpret=self.interpret)


def fused_linear_backend(program, model) -> PallasFusedLinear | None:
    """The fused-linear backend of `program` (StepProgram.fused_linears) for `model`, or None
    where the plain linears run: a model the fused block does not cover (models/fused.py
    fusable), widths the kernel's 16-column tiles do not divide, quantized weights (the kernel
    reads float ones), LoRA slots (the adapters' delta sits between a projection and what
    follows it)."""
    if not program.fused_linears:
        return None
    c = model.config
    widths = (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim,
              c.num_kv_heads * c.head_dim)
    leaves = jax.tree.leaves(model.params, is_leaf=is_quantized)
    backend = PallasFusedLinear(interpret=program.linear_backend == "pallas-interpret")
    why = (fusable(c) or
           (f"widths {widths} not all multiples of the kernel's {backend.tile}-column tile"
            if any(w % backend.tile for w in widths) else None) or
           ("quantized weights" if any(is_quantized(w) for w in leaves) else None) or
           ("LoRA adapters" if program.lora is not None else None))
    if why is not None:
        log.info("fused linears off: %s", why)
        return None
    return backend


def head_backend(kind: str):
    """The tied LM head `head(x [..., D], embedding [V, D]) -> [..., V]` float32 logits: the
    native float matmul reading the embedding as stored at few rows on `cpu` (as
    linear_backend), models/llama.py's einsum otherwise."""
    if not native_float(kind):
        return tied_head

    def head(x, embedding):
        if _native_rows(x, embedding):
            return float_matmul.float_matmul_cpu(x, embedding, transposed=True)
        return tied_head(x, embedding)

    return head
