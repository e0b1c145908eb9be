"""Tiny random Mistral / Gemma 2 / Gemma 3 text models (made by transformers in .venv-ref) whose
sliding windows are shorter than the test prompts, so the window really cuts."""

import numpy as np

from hf_reference import run_reference

WINDOW = 12  # no block size (powers of 2) divides it
BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            sliding_window=WINDOW, initializer_range=0.2)
GEMMA = dict(BASE, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
             tie_word_embeddings=True)
MODELS = [
    {"name": "mistral", "arch": "mistral", "seed": 0,
     "config": dict(BASE, num_hidden_layers=3, rope_theta=10000.0, tie_word_embeddings=False)},
    # Small caps so that the soft-capping changes the logits of a tiny random model.
    {"name": "gemma2", "arch": "gemma2", "seed": 1,
     "config": dict(GEMMA, num_hidden_layers=4, attn_logit_softcapping=3.0,
                    final_logit_softcapping=5.0)},
    # 7 layers at the default 5 local : 1 global pattern: layer 5 is the global one.
    {"name": "gemma3", "arch": "gemma3_text", "seed": 2,
     "config": dict(GEMMA, num_hidden_layers=7, rope_theta=100000.0,
                    rope_local_base_freq=5000.0)},
]
NAMES = [m["name"] for m in MODELS]
_rng = np.random.default_rng(7)
PROMPTS = [[5, 17, 42, 3, 200, 7, 7, 7, 1], [int(t) for t in _rng.integers(1, 211, 70)], [9]]
# >= 8 prompts longer than the window, of lengths that cross block and chunk boundaries.
GREEDY_PROMPTS = [[int(t) for t in _rng.integers(1, 211, n)]
                  for n in (13, 20, 25, 31, 33, 40, 47, 58, 64)]
# Prompts that share their first 40 tokens (5 blocks of 8) with a greedy prompt above: served
# after it, they take its cached blocks (prefix caching under a window).
SHARED_PROMPTS = [GREEDY_PROMPTS[i][:40] + [int(t) for t in _rng.integers(1, 211, n)]
                  for i, n in ((6, 9), (7, 3), (8, 17))]
MAX_NEW_TOKENS = 8


def windowed_reference():
    return run_reference("ref_windowed_hf", {
        "models": MODELS, "prompts": PROMPTS, "greedy_prompts": GREEDY_PROMPTS + SHARED_PROMPTS,
        "max_new_tokens": MAX_NEW_TOKENS})
