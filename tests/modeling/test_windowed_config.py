"""Parsing Mistral / Gemma 2 / Gemma 3 config.json files (models/windowed.py), in both the
transformers >= 5 layout and the older one (no layer_types, rope_local_base_freq)."""

import pytest

from models.config import ModelConfig
from models.windowed import NO_WINDOW, layer_windows

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_gemma3_old_layout_matches_new():
    old = ModelConfig.from_hf(dict(BASE, model_type="gemma3_text", sliding_window=16,
                                   sliding_window_pattern=6, rope_theta=1e6,
                                   rope_local_base_freq=1e4, query_pre_attn_scalar=8))
    new = ModelConfig.from_hf(dict(
        BASE, model_type="gemma3_text", sliding_window=16, query_pre_attn_scalar=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    assert old == new
    assert (old.rope_theta, old.rope_local_theta, old.qk_norm) == (1e6, 1e4, "per_head")
    assert list(layer_windows(old)) == [16] * 5 + [NO_WINDOW, 16]


def test_gemma2_defaults_and_mistral_without_window():
    g2 = ModelConfig.from_hf(dict(BASE, model_type="gemma2", num_hidden_layers=4))
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (g2.sliding_window, g2.attn_logit_softcapping, g2.final_logit_softcapping,
            g2.query_pre_attn_scalar, g2.tie_word_embeddings) == (4096, 50.0, 30.0, 256.0, True)
    mistral = ModelConfig.from_hf(dict(BASE, architectures=["MistralForCausalLM"],
                                       sliding_window=None))
    assert mistral.architecture == "mistral" and layer_windows(mistral) is None


def test_gemma3_unsupported_local_rope_is_refused():
    with pytest.raises(ValueError, match="local layers"):
        ModelConfig.from_hf(dict(BASE, model_type="gemma3_text", rope_parameters={
            "full_attention": {"rope_type": "default"},
            "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}))
