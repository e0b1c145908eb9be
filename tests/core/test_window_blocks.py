"""Counting the KV blocks a sliding window has left behind (jaxserve/core/window_blocks.py),
against a brute force over positions."""

import numpy as np
import pytest

from jaxserve.core.window_blocks import slid_past_blocks
from models.config import ModelConfig
from models.windowed import NO_WINDOW, model_window


def brute_force(n, block_size, window):
    """Leading blocks none of whose positions a query at n or later sees."""
    seen = np.arange(n + block_size * 4) > n - window  # positions the next query may see
    dead = 0
    while dead * block_size < n and not seen[dead * block_size:(dead + 1) * block_size].any():
        dead += 1
    return dead


@pytest.mark.parametrize("block_size", [1, 4, 8, 16])
@pytest.mark.parametrize("window", [1, 5, 12, 16, 40])
def test_matches_brute_force(block_size, window):
    for n in range(0, 100):
        assert slid_past_blocks(n, block_size, window) == brute_force(n, block_size, window)
    assert slid_past_blocks(99, block_size, None) == 0


def test_model_window_needs_every_layer_windowed():
    base = dict(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=8)
    assert model_window(ModelConfig(**base)) is None
    assert model_window(ModelConfig(**base, sliding_window=12)) == 12  # Mistral: all slide
    gemma = ModelConfig(**base, sliding_window=12,
                        layer_types=("sliding_attention", "full_attention"))
    assert model_window(gemma) is None  # a global layer reads everything
    assert NO_WINDOW > 10**9
