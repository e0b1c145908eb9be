"""Tiny Llama shapes shared by tests that need a random model but not its exact size."""

from models.config import ModelConfig

# GQA (4 query heads over 2 KV heads), untied head: engine, profiling and server tests.
TINY_GQA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)

# Tied embeddings and K = 128 (a whole int4/int8 group): quantization tests.
TINY_TIED = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=128,
                        tie_word_embeddings=True)

# TINY_GQA's shapes with a longer context: the server tests' model, which carries the
# 256-token tokenizer of tiny_chat.py.
TINY_CHAT = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
