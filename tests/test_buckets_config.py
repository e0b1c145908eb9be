"""Shape buckets, engine config validation and KV memory planning (no model needed)."""

import pytest

from jaxserve.runtime import buckets
from jaxserve.config import EngineConfig
from jaxserve.runtime.kv_cache import plan_num_blocks
from models.config import ModelConfig

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_ragged_buckets_add_midpoints_and_cover_the_limit():
    assert buckets.ragged_block_buckets(64, 64) == [64, 96, 128, 192, 256, 384, 512, 768, 1024,
                                                    1536, 2048, 3072, 4096]
    assert buckets.ragged_block_buckets(1, 5) == [1, 2, 3, 4, 5]
    assert buckets.ragged_block_buckets(1, 1) == [1]
    for rows, nb in [(1, 64), (4, 33), (16, 7)]:
        b = buckets.ragged_block_buckets(rows, nb)
        assert b == sorted(set(b)) and b[0] == rows and b[-1] == rows * nb
        for n in range(rows, rows * nb + 1):  # every size fits with at most 50% padding
            assert buckets.pick(b, n) <= max(rows, 1.5 * n)


def test_powers_of_two_end_at_the_limit():
    assert buckets.powers_of_two_up_to(100, 16) == [16, 32, 64, 100]
    assert buckets.powers_of_two_up_to(64, 16) == [16, 32, 64]
    assert buckets.powers_of_two_up_to(1) == [1]
    assert buckets.decode_batch_buckets(64) == [1, 4, 16, 64]
    assert buckets.decode_batch_buckets(10) == [1, 4, 10]


@pytest.mark.parametrize("n,expected", [(1, 16), (16, 16), (17, 32), (100, 100)])
def test_pick_smallest_fitting_bucket(n, expected):
    assert buckets.pick([16, 32, 64, 100], n) == expected


def test_pick_beyond_largest_raises():
    with pytest.raises(ValueError, match="exceeds the largest bucket 100"):
        buckets.pick([16, 100], 101)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_every_prefill_chunk_fits_some_bucket(block_size):
    max_blocks = 2048 // block_size
    for tokens in range(1, 513):
        tb = buckets.pick(buckets.prefill_token_buckets(512), tokens)
        widths = buckets.prefill_block_buckets(tb, block_size, max_blocks)
        # A chunk starting at 0 fits the narrow width; any context fits the widest.
        assert widths[0] * block_size >= min(tokens, max_blocks * block_size)
        assert widths[-1] == max_blocks


def test_kv_bytes_per_token_uses_kv_heads():
    # 2 (K and V) * 30 layers * 3 KV heads * 64 dims * 4 bytes: a third of 2*L*d_model*4.
    assert SMOLLM2.kv_bytes_per_token(4) == 46080 == 2 * 30 * 576 * 4 // 3
    assert plan_num_blocks(SMOLLM2, 16, 4, 46080 * 16 * 10 + 5) == 10


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
