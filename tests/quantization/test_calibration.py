"""Calibration windows from text, and the layer-wise linear inputs GPTQ/AWQ are fitted on."""

import dataclasses

import numpy as np
import pytest

from jaxserve.quantization.calibration import (Calibration, from_text, load_calibration,
                                               random_calibration, windows)
from jaxserve.quantization.calibration_text import CALIBRATION_TEXT
from jaxserve.quantization.layerwise import LayerForward, embed, layer_slice
from models.config import ModelConfig
from models.random_init import random_model


class CharTokenizer:
    """One id per byte: enough to test the windowing without a real vocabulary."""

    def __init__(self, add_bos):
        self.add_bos, self.bos_token_id = add_bos, 1

    def encode(self, text):
        return list(text.encode())


def test_windows_cut_without_overlap():
    ids = np.arange(100)
    got = windows(ids, 10, bos=None)
    assert got.shape == (10, 10) and (got.reshape(-1) == ids).all()
    got = windows(ids, 10, max_seqs=3, bos=7)
    assert got.shape == (3, 10) and (got[:, 0] == 7).all()
    assert (got[:, 1:].reshape(-1) == ids[:27]).all()
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(ids[:5], 10)


@pytest.mark.parametrize("add_bos", [False, True])
def test_builtin_and_file_text(tmp_path, add_bos):
    model = dataclasses.replace(random_model(ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=32)), tokenizer=CharTokenizer(add_bos))
    calib = load_calibration(model, seq_len=64, max_seqs=None)
    body = 64 - add_bos
    assert calib.tokens.shape == (len(CALIBRATION_TEXT.encode()) // body, 64)
    assert calib.source == "built-in text"
    path = tmp_path / "my.txt"
    path.write_text("abc" * 100, encoding="utf-8")
    calib = load_calibration(model, path, seq_len=32, max_seqs=2)
    assert calib.tokens.shape == (2, 32) and calib.tokens[0, int(add_bos)] == ord("a")
    with pytest.raises(FileNotFoundError):
        load_calibration(model, tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no tokenizer"):
        from_text(None, "text")
    with pytest.raises(ValueError, match="non-empty"):
        Calibration(np.zeros((0,), np.int32), "x")


def test_layer_stages_compose_to_the_model():
    """Running LayerForward layer by layer then the final norm and tied head gives the model's
    logits: the captured inputs are those of the served model."""
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    model = random_model(config, seed=1)
    tokens = random_calibration(128, 2, 12).tokens
    fwd = LayerForward(config)
    x, positions = embed(model.params, tokens)
    for i in range(config.num_layers):
        inputs, x = fwd.linear_inputs(layer_slice(model.params, i), x, positions)
        assert inputs["q_proj"].shape == (24, 64) and inputs["down_proj"].shape == (24, 96)
        assert inputs["o_proj"].shape == (24, 64)
    x = np.asarray(x, np.float64)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps)
    x = x * np.asarray(model.params["final_norm"]["scale"])
    logits = x @ np.asarray(model.params["embedding"]).T  # [S, T, V]
    for s in range(2):
        np.testing.assert_allclose(logits[s], model.forward_logits(tokens[s]), rtol=1e-4,
                                   atol=1e-4)
