"""Engine configuration: one frozen dataclass, validated with messages a user can act on.

Every set of choices is a `Literal` declared once, here (dtypes in models/config.py, which
models/ reads without jaxserve); validation, error messages and the CLI's `choices=` all read it
with `typing.get_args`. Each field's help is its `metadata["help"]`: the CLI's engine flags are
generated from the fields (jaxserve/config_fields.py), so `generate`, `serve` and `bench` offer
the same flags with these defaults. The CLI imports this module before jax starts: no jax here.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Literal, Mapping, get_args

from jaxserve.config_fields import check_choices
from jaxserve.telemetry.kv_event_publisher import kv_event_endpoint
from jaxserve.core.block_manager import validate_block_size
from jaxserve.core.scheduler import SchedulerConfig
from jaxserve.faults import FaultConfig
from jaxserve.core.pooling import PoolingType
from jaxserve.core.spec_decode.config import SpeculativeConfig
from models.config import Dtype

# Which implementation runs inside the jitted step (jaxserve/runtime/backends.py).
Backend = Literal["auto", "xla", "cpu", "pallas", "pallas-interpret"]
# Inference paths (jaxserve/quantization/paths.py), and other names accepted for them.
QuantizationPath = Literal["w8a16", "w4a16", "w8a8", "w4a8", "gguf"]
QuantizationAlias = Literal["int4"]
QUANTIZATION_ALIASES: Mapping[QuantizationAlias, QuantizationPath] = MappingProxyType(
    {"int4": "w4a16"})
# auto: a model carrying a GGUF file's quantized blocks serves them ("gguf", as llama.cpp and
# vLLM do), a quantized checkpoint its own path, anything else its float weights; none: float
# weights, a GGUF file's blocks dequantized.
QuantizationMode = Literal["auto", "none"]
Quantization = Literal[QuantizationMode, QuantizationPath, QuantizationAlias]
# int8: codes plus a float32 scale per (token, KV head), dequantized inside the attention
# (jaxserve/runtime/kv_quant.py).
KVCacheDtype = Literal["auto", Dtype, "int8"]
LayerLoop = Literal["auto", "scan", "unrolled"]
# Which Pallas GPU backend the attention, int4 and MoE kernels lower through: Mosaic GPU (Hopper
# and later: TMA, wgmma) or Triton (any CUDA GPU; deprecated by JAX for Hopper and later).
GpuKernels = Literal["auto", "mosaic", "triton"]

BACKENDS = get_args(Backend)
GPU_KERNELS = get_args(GpuKernels)
QUANTIZATION_PATHS = get_args(QuantizationPath)
QUANTIZATION_MODES = get_args(QuantizationMode)
QUANTIZATIONS = get_args(Quantization)
KV_CACHE_DTYPES = get_args(KVCacheDtype)


def _help(text: str, **metadata) -> dict:
    return {"help": text, **metadata}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What to serve and how much of the machine to use.

    The KV cache size comes from a memory budget: `kv_cache_memory` bytes if given, else
    `gpu_memory_utilization` of free accelerator memory, else (CPU) a 1 GiB default.
    `max_model_len` defaults to the model's context length, capped by what the cache holds.
    With `tensor_parallel_size` N > 1 the budget is per device, each holding 1/N of the KV heads.

    Defaults are what a vLLM user expects (the model's context length, a batch sized for an
    accelerator), one default per field for the Python API and the CLI alike. On CPU,
    `max_num_seqs=16, max_model_len=2048` keeps `serve`'s warm-up short (fewer shape buckets).
    """

    model: str = dataclasses.field(default="smollm2-135m", metadata=_help(
        "model name, .gguf file, HF directory or orbax checkpoint"))
    # GPUs read half the bytes and run the bf16 kernels; on CPU float32 is the faster path.
    dtype: Dtype | None = dataclasses.field(default=None, metadata=_help(
        "weight and activation dtype; default: bfloat16 on GPU, float32 on CPU "
        "(kv_cache_dtype auto follows it)"))
    block_size: int = dataclasses.field(default=16, metadata=_help(
        "tokens per KV block (a power of 2)"))
    max_num_seqs: int = dataclasses.field(default=64, metadata=_help(
        "batch slots: sequences running at once (vLLM: 256 on GPUs; 16 keeps a CPU warm-up "
        "short)"))
    max_num_batched_tokens: int = dataclasses.field(default=512, metadata=_help(
        "tokens per engine step (decodes plus prefill chunks); at least max_num_seqs"))
    max_model_len: int | None = dataclasses.field(default=None, metadata=_help(
        "longest prompt + output; default: the model's context length, capped by what the KV "
        "cache holds (2048 keeps a CPU warm-up short)"))
    kv_cache_memory: int | None = dataclasses.field(default=None, metadata=_help(
        "KV cache bytes (per device with tensor parallelism); default: "
        "gpu_memory_utilization of free accelerator memory, 1 GiB on CPU"))
    gpu_memory_utilization: float = dataclasses.field(default=0.85, metadata=_help(
        "fraction of free accelerator memory for the KV cache (without kv_cache_memory)"))
    enable_chunked_prefill: bool = dataclasses.field(default=True, metadata=_help(
        "split prompts longer than a step's token budget over several steps"))
    # Reuse the KV of full blocks whose prefix (token ids up to and including the block) was
    # computed before; freed blocks stay cached until evicted, least recently used first.
    enable_prefix_caching: bool = dataclasses.field(default=True, metadata=_help(
        "reuse cached KV blocks of shared prompt prefixes instead of recomputing them",
        aliases=("--prefix-caching",)))
    attention_backend: Backend = dataclasses.field(default="auto", metadata=_help(
        "paged attention: pallas (GPU kernel), cpu (native CPU kernel), xla, pallas-interpret "
        "(GPU kernel on CPU, for tests); auto: pallas on GPU, cpu on CPU where it builds, "
        "else xla"))
    linear_backend: Backend = dataclasses.field(default="auto", metadata=_help(
        "quantized linears: pallas (int4 GPU kernel), cpu (native int4/int8 CPU kernel), xla, "
        "pallas-interpret; auto: pallas on GPU, cpu on CPU where it builds, else xla"))
    gpu_kernels: GpuKernels = dataclasses.field(default="auto", metadata=_help(
        "which Pallas backend the GPU attention, int4 and MoE kernels use: mosaic (Mosaic GPU, "
        "compute capability >= 9.0), triton (any CUDA GPU); auto: mosaic on compute "
        "capability >= 9.0, triton below and when interpreted on CPU"))
    # A decode step's block as six kernels instead of ~15 on a GPU (docs/gpu_step_report.md);
    # off compiles XLA's fusions and GEMMs, for comparison.
    fused_linears: bool = dataclasses.field(default=True, metadata=_help(
        "GPU decode steps run each block's norms, projections, RoPE, SiLU and residual adds "
        "in the Pallas fused-linear kernel (float weights, Llama-family blocks, no LoRA); "
        "off: XLA's fusions and GEMMs"))
    quantization: Quantization = dataclasses.field(default="auto", metadata=_help(
        "w8a16, w4a16 (alias int4), w8a8, w4a8: int8/int4 weights by round-to-nearest, int8 "
        "activations per token (w8a8, w4a8); gguf: a .gguf file's own Q4_0/Q4_1/Q8_0 blocks; "
        "none: float weights (a .gguf file dequantized); auto: gguf for a .gguf file with "
        "such blocks on one device, a quantized checkpoint's own path, else none"))
    seed: int = dataclasses.field(default=0, metadata=_help(
        "engine seed: a request without a seed of its own draws one from it (bench: also the "
        "workload's seed)"))
    async_scheduling: bool = dataclasses.field(default=True, metadata=_help(
        "schedule and prepare each step while the previous one runs on the device (outputs "
        "are the same; off: the synchronous loop, for debugging)"))
    # Each command decides: a one-shot `generate` compiles only the shapes it meets; `serve`
    # compiles every bucket first.
    warmup: bool = dataclasses.field(default=True, metadata=_help(
        "compile every shape bucket at start-up", cli=False))
    # Constrained rows run a second program per token bucket (the sampler with a token
    # bitmask), compiled after warm-up on a thread of its own: off halves the step programs.
    structured_outputs: bool = dataclasses.field(default=True, metadata=_help(
        "serve JSON-schema / regex / choice / grammar constraints and tool calls (compiles a "
        "masked variant of every step program after warm-up, while serving)"))
    layer_loop: LayerLoop = dataclasses.field(default="auto", metadata=_help(
        "how the step runs the layers: scan (one loop over stacked weights: compile time flat "
        "in depth), unrolled (one block per layer: no weight slice is copied, slower "
        "compiles, about twice the warm start on CPU); auto: unrolled on GPU and for weights "
        "repacked for the native CPU quantized matmul, scan elsewhere (float weights on CPU: "
        "unrolled decodes faster at batch 1, scan starts faster); tensor parallel always scans"))
    weights_cache: bool = dataclasses.field(default=True, metadata=_help(
        "keep a GGUF file's converted weights in the cache directory so the next start skips "
        "dequantizing it (models/weights_cache.py)"))
    profile_dir: str | None = dataclasses.field(default=None, metadata=_help(
        "write jax.profiler traces here for TensorBoard/Perfetto (jaxserve/telemetry/profiling.py); "
        "serve: enables POST /start_profile and /stop_profile"))
    # "bfloat16" halves the bytes each decode step reads (and doubles the tokens a budget holds)
    # at bf16 rounding of K/V; "int8" stores 1 byte per element plus a float32 scale per
    # (token, KV head): 0.27x float32's bytes at head_dim 64 (docs/quantization.md).
    kv_cache_dtype: KVCacheDtype = dataclasses.field(default="auto", metadata=_help(
        "K/V storage; auto: the model's dtype (bfloat16 halves decode's KV reads); int8: "
        "int8 codes with a scale per token and KV head, dequantized inside the attention"))
    # jaxserve/runtime/sharding.py; must not exceed jax.device_count().
    tensor_parallel_size: int = dataclasses.field(default=1, metadata=_help(
        "devices to split every layer over (at most jax.device_count())"))
    # Admission control (jaxserve/core/admission.py): add_request raises EngineOverloaded
    # beyond them, and the server answers 503 with Retry-After. None: unbounded (serve: 128
    # requests).
    max_waiting_requests: int | None = dataclasses.field(default=None, metadata=_help(
        "requests waiting for a batch slot before new ones are refused (serve: 503; default "
        "unbounded, serve 128)"))
    max_waiting_tokens: int | None = dataclasses.field(default=None, metadata=_help(
        "prompt tokens of waiting requests before new ones are refused (serve: 503; default "
        "unbounded)"))
    # Tests only (jaxserve/faults.py); the JAXSERVE_FAULTS environment variable sets it too.
    faults: str | None = dataclasses.field(default=None, metadata=_help(
        "fault injection for tests, e.g. 'step_raise=3' (jaxserve/faults.py; default "
        "$JAXSERVE_FAULTS, else off)"))
    # core/spec_decode/config.py; a dict (vLLM's form) or JSON text is turned into one.
    speculative_config: SpeculativeConfig | None = dataclasses.field(default=None, metadata=_help(
        "speculative decoding, as JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}' or '{\"method\": \"draft_model\", \"model\": ..., "
        "\"draft_quantization\": \"w8a8\"}' (docs/speculative.md)"))

    # KV-cache events in vLLM's ZMQ wire format for KV-aware routers
    # (jaxserve/telemetry/kv_event_publisher.py).
    kv_events_endpoint: str | None = dataclasses.field(default=None, metadata=_help(
        "publish KV-cache events (blocks stored / removed / all cleared) in vLLM's ZMQ wire "
        "format for llm-d's KV-cache indexer and Dynamo's router: tcp://*:5557 binds (a '*' "
        "or '::' host, or ipc://PATH), tcp://HOST:PORT connects; needs prefix caching"))
    # vLLM's name: a replica's rank among data-parallel replicas of one model.
    data_parallel_rank: int = dataclasses.field(default=0, metadata=_help(
        "this replica's rank among data-parallel replicas: the KV-events publisher binds "
        "port + rank and stamps it on every batch, as vLLM does"))

    # LoRA adapters (docs/lora.md): vLLM's names.
    enable_lora: bool = dataclasses.field(default=False, metadata=_help(
        "serve LoRA adapters (PEFT format) over the base model, rows of different adapters "
        "in one batch"))
    max_loras: int = dataclasses.field(default=1, metadata=_help(
        "adapters on the device at once (device slots); requests of other adapters wait"))
    max_lora_rank: int = dataclasses.field(default=16, metadata=_help(
        "largest adapter rank served; every slot is padded to it"))
    max_cpu_loras: int | None = dataclasses.field(default=None, metadata=_help(
        "adapters kept loaded in host memory (least recently used dropped first); default: "
        "max_loras"))

    # Embeddings (docs/embeddings.md): prompt-only requests that pool the final hidden states,
    # batched in the same steps as generation. Off: no pooled programs are compiled.
    enable_embeddings: bool = dataclasses.field(default=False, metadata=_help(
        "serve embedding requests (POST /v1/embeddings, LLM.embed) from this decoder model, "
        "in the same batches as generation (compiles a pooled variant of every step program "
        "at warm-up)"))
    pooling: PoolingType = dataclasses.field(default="last", metadata=_help(
        "how an embedding pools the prompt's final hidden states (after the final norm), "
        "L2-normalised: last (the last token's, as vLLM does for decoder LMs) or mean (over "
        "every prompt token)"))

    def __post_init__(self):
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        check_choices(self)  # dtype, backends, quantization, kv_cache_dtype
        validate_block_size(self.block_size)
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode "
                f"each step; raise max_num_batched_tokens or lower max_num_seqs")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and (
                not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0):
            raise ValueError("kv_cache_memory is a byte count and must be a positive integer, "
                             f"got {self.kv_cache_memory!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.profile_dir is not None and (not isinstance(self.profile_dir, str)
                                             or not self.profile_dir):
            raise ValueError(f"profile_dir must be a directory path (str) or None, got "
                             f"{self.profile_dir!r}")
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
        FaultConfig.parse(self.faults)  # a bad spec fails here, naming the key
        rank = self.data_parallel_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"data_parallel_rank must be an integer >= 0, got {rank!r}")
        if self.kv_events_endpoint is not None:
            kv_event_endpoint(self.kv_events_endpoint, rank)  # raises, saying what is wrong
            if not self.enable_prefix_caching:
                raise ValueError("kv_events_endpoint reports the prefix cache's blocks: it "
                                 "needs enable_prefix_caching=True")
        self._check_lora()
        if not isinstance(self.enable_embeddings, bool):
            raise ValueError(f"enable_embeddings must be True or False, got "
                             f"{self.enable_embeddings!r}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            # The file's blocks are served as stored, but tensor parallelism may pad heads (and
            # Q4 groups of 32 would have to be re-laid per shard): not supported yet.
            raise ValueError("quantization='gguf' runs on one device; with "
                             "tensor_parallel_size > 1 use w8a16, w8a8, w4a16 or w4a8")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras ({cpu!r}) must be an integer >= max_loras "
                             f"({self.max_loras}), or None")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        spec = self.speculative_config
        if self.enable_lora and spec is not None and spec.method == "draft_model":
            raise ValueError("enable_lora with a draft model is not supported (the draft has "
                             "no adapters); use speculative method 'ngram' with LoRA")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in host memory (max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def scheduler_config(self, *, num_blocks: int, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits: this config's, plus what the engine derived from the model
        and the KV budget (SchedulerConfig checks those two against the rest)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len, block_size=self.block_size, num_blocks=num_blocks,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_events=self.kv_events_endpoint is not None,
            max_loras=self.max_loras if self.enable_lora else 0)
