"""GPU defaults, on a CPU made to look like a GPU: bfloat16 weights and KV cache, Pallas
backends, the KV cache sized from the device's free memory, and the GPU step's shape
(unrolled layers, branch-free sampler). CPU keeps float32 and its own backends."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import engine_build
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.runtime import backends
from models.checkpoint import save
from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA

GIB = 1 << 30
# TINY_GQA with the Pallas kernel's head_dim, so that auto picks the kernel.
TINY = dataclasses.replace(TINY_GQA, head_dim=64)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A float32 checkpoint on disk, so the engine loads it in the dtype it chooses."""
    return save(random_model(TINY, "float32"), tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def fake_gpu(monkeypatch):
    """jax reports a GPU backend and 3 GiB of device memory, 1 GiB of it in use (small: the
    planned cache is really allocated, in this machine's memory)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(engine_build, "_memory_stats",
                        lambda: {"bytes_limit": 3 * GIB, "bytes_in_use": 1 * GIB})


def test_backends_and_dtype_resolve_for_the_gpu(fake_gpu):
    assert backends.resolve("auto") == "pallas"
    assert backends.resolve("auto", attention=True) == "pallas"
    assert backends.default_dtype(None) == "bfloat16"
    assert backends.default_dtype("float32") == "float32"  # an explicit choice stays
    assert backends.gpu_step()


def test_engine_on_a_gpu_defaults_to_bfloat16_and_plans_kv_from_free_memory(
        fake_gpu, tiny_checkpoint):
    # warmup off: the Pallas kernels cannot compile for the CPU this really is.
    eng = LLMEngine(EngineConfig(model=str(tiny_checkpoint), warmup=False, max_num_seqs=4,
                                 max_num_batched_tokens=16, max_model_len=64))
    c, bs = TINY, eng.config.block_size
    assert eng.model.dtype == "bfloat16"
    assert eng.model.params["embedding"].dtype == np.dtype("bfloat16")
    assert eng.runner.cache.k.dtype == np.dtype("bfloat16")  # kv_cache_dtype auto follows
    assert eng.runner.attention.name == "pallas"
    # 0.85 of the 2 GiB free, in blocks of bs tokens x (K and V) x layers x heads x dim x 2 B.
    per_block = bs * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    assert eng.runner.cache.k.shape[1] == int(2 * GIB * 0.85) // per_block
    assert eng.runner.branch_free_sampling
    assert eng.runner.unroll_layers


def test_engine_on_cpu_keeps_float32_and_its_own_defaults(tiny_checkpoint):
    eng = LLMEngine(EngineConfig(model=str(tiny_checkpoint), warmup=False, max_num_seqs=4,
                                 max_num_batched_tokens=16, max_model_len=64))
    assert eng.model.dtype == "float32"
    assert eng.runner.cache.k.dtype == np.dtype("float32")
    assert eng.runner.attention.name in ("cpu", "xla")
    assert eng.runner.cache.k.shape[1] == engine_build.CPU_KV_CACHE_BYTES // (
        eng.config.block_size * TINY.kv_bytes_per_token(4))
    assert not eng.runner.branch_free_sampling and not eng.runner.unroll_layers
