"""Engine configuration: one frozen dataclass, validated with messages a user can act on."""

from __future__ import annotations

import dataclasses

from jaxserve.core.block_manager import validate_block_size

BACKENDS = ("auto", "xla", "pallas", "pallas-interpret")
# Inference paths (jaxserve/quantization/paths.py); "int4" is an alias of "w4a16".
QUANTIZATIONS = (None, "w8a16", "w4a16", "w8a8", "gguf", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What to serve and how much of the machine to use.

    The KV cache size comes from a memory budget: `kv_cache_memory` bytes if given, else
    `gpu_memory_utilization` of free accelerator memory, else (CPU) a 1 GiB default.
    `max_model_len` defaults to the model's context length, capped by what the cache holds.
    With `tensor_parallel_size` N > 1 the budget is per device, each holding 1/N of the KV heads.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_chunked_prefill: bool = True
    # Reuse the KV of full blocks whose prefix (token ids up to and including the block) was
    # computed before; freed blocks stay cached until evicted, least recently used first.
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    quantization: str | None = None  # one of QUANTIZATIONS; None: the weights as loaded
    seed: int = 0
    warmup: bool = True
    profile_dir: str | None = None  # where jax.profiler captures go (jaxserve/tools/profiling.py)
    # K/V storage: "auto" = the model's dtype; "bfloat16" halves the bytes each decode step
    # reads (and doubles the tokens a budget holds) at bf16 rounding of K/V.
    kv_cache_dtype: str = "auto"
    # Devices to split each layer over (jaxserve/runtime/sharding.py); must not exceed jax.device_count().
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        validate_block_size(self.block_size)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and (
                not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0):
            raise ValueError("kv_cache_memory is a byte count and must be a positive integer, "
                             f"got {self.kv_cache_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        for name in ("attention_backend", "linear_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"{name} must be one of {BACKENDS}, got "
                                 f"{getattr(self, name)!r}")
        if self.profile_dir is not None and (not isinstance(self.profile_dir, str)
                                             or not self.profile_dir):
            raise ValueError(f"profile_dir must be a directory path (str) or None, got "
                             f"{self.profile_dir!r}")
        if isinstance(self.tensor_parallel_size, bool) or \
                not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be a positive integer, got "
                             f"{self.tensor_parallel_size!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            # The file's blocks are served as stored, but tensor parallelism may pad heads (and
            # Q4 groups of 32 would have to be re-laid per shard): not supported yet.
            raise ValueError("quantization='gguf' runs on one device; with "
                             "tensor_parallel_size > 1 use w8a16, w8a8 or w4a16")
