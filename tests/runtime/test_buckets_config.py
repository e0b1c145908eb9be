"""Shape buckets, engine config validation and KV memory planning (no model needed)."""

import numpy as np
import pytest

from jaxserve.runtime import buckets
from jaxserve.config import EngineConfig
from jaxserve.runtime.kv_cache import plan_num_blocks
from models.config import ModelConfig

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_powers_of_two_end_at_the_limit():
    assert buckets.powers_of_two_up_to(100, 16) == [16, 32, 64, 100]
    assert buckets.powers_of_two_up_to(64, 16) == [16, 32, 64]
    assert buckets.powers_of_two_up_to(1) == [1]
    assert buckets.slot_write_buckets(64) == [1, 4, 16, 64]
    assert buckets.slot_write_buckets(10) == [1, 4, 10]


@pytest.mark.parametrize("n,expected", [(1, 16), (16, 16), (17, 32), (100, 100)])
def test_pick_smallest_fitting_bucket(n, expected):
    assert buckets.pick([16, 32, 64, 100], n) == expected


def test_pick_beyond_largest_raises():
    with pytest.raises(ValueError, match="exceeds the largest bucket 100"):
        buckets.pick([16, 100], 101)


def test_kv_bytes_per_token_uses_kv_heads():
    # 2 (K and V) * 30 layers * 3 KV heads * 64 dims * 4 bytes: a third of 2*L*d_model*4.
    assert SMOLLM2.kv_bytes_per_token(4) == 46080 == 2 * 30 * 576 * 4 // 3
    assert plan_num_blocks(SMOLLM2, 16, np.float32, 46080 * 16 * 10 + 5) == 10


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="float16"), "dtype must be"),
    (dict(block_size=24), "block_size"),
    (dict(block_size=512), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_model_len=1), "max_model_len must be an integer >= 2"),
    (dict(kv_cache_memory=-5), "kv_cache_memory is a byte count"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="cudnn"), "attention_backend must be one of"),
    (dict(linear_backend="triton"), "linear_backend must be one of"),
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="gguf", tensor_parallel_size=2), "gguf.* runs on one device"),
])
def test_engine_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
