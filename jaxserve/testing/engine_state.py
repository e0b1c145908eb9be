"""A tiny engine with several KV blocks per request and prefix caching: the engine of the
engine-state endpoint and browser tests (tests/engine_state_fixtures.py serves it) and of
scripts/bench_engine_state.py."""

from __future__ import annotations

from jaxserve import EngineConfig, LLMEngine
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16  # 8 blocks for a full-length request: a block map with something to show


def tiny_engine() -> LLMEngine:
    model = tiny_chat_model(seed=0)
    kv = 3 * MAX_NUM_SEQS * MAX_MODEL_LEN * TINY_CHAT.kv_bytes_per_token(4)
    return LLMEngine(EngineConfig(model=model.source, warmup=True, max_num_seqs=MAX_NUM_SEQS,
                                  max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                                  block_size=BLOCK_SIZE, kv_cache_memory=kv,
                                  enable_prefix_caching=True), model=model)
