"""Quantized paths on a sliding-window, soft-capped model (the Gemma 2 shape of
tests/tp_worker.py, random weights): the paged engine equals a dense greedy loop over the same
quantized params and linear backend, per path, as tests/quantization/test_quantized_engine.py
checks for Llama. The window (6) is shorter than the prompts."""

import pytest

from jaxserve.quantization.paths import activation_bits, prepare_model
from jaxserve.runtime import backends
from models.random_init import random_model
from test_quantized_engine import PROMPTS, dense_greedy, engine_greedy
from tp_worker import GEMMA2


@pytest.mark.parametrize("path", ["w8a16", "w8a8", "w4a16"])
def test_engine_equals_dense_oracle_on_quantized_params(path):
    model = random_model(GEMMA2, seed=5)
    qmodel, served = prepare_model(model, path)
    assert served == path and qmodel.quantization == path
    assert max(len(p) for p in PROMPTS) > GEMMA2.sliding_window
    linear = backends.linear_backend("xla", activation_bits(path))
    want = [dense_greedy(qmodel, qmodel.params, linear, p) for p in PROMPTS]
    assert engine_greedy(model, PROMPTS, path) == want
