"""Tensor parallelism with sliding-window, soft-capped attention (a Gemma 2 shape, random
weights): the same greedy tokens on 1 and 2 devices with the XLA path (sharding annotations)
and with the Pallas kernel per shard (shard_map: the layer's window crosses it as a replicated
scalar), and both equal to the dense oracle (the window applied in models/llama.py, itself
checked against HF in tests/modeling/test_windowed_hf.py)."""

import numpy as np
import pytest

from models.random_init import random_model
from test_tensor_parallel import run_worker
from tp_worker import GEMMA2, prompts

pytestmark = [pytest.mark.timeout(1000), pytest.mark.subprocess]


@pytest.fixture(scope="module")
def runs():
    return run_worker({
        "xla": ["tokens", {"config_name": "gemma2", "sizes": [1, 2]}],
        "kernel": ["tokens", {"config_name": "gemma2", "sizes": [2],
                              "attention_backend": "pallas-interpret"}],
    })


def test_tensor_parallel_greedy_equals_dense(runs):
    model = random_model(GEMMA2, seed=3)  # the worker's weights
    want = [model.greedy_generate(p, 5, stop_token_ids=()) for p in prompts(GEMMA2.vocab_size)]
    assert max(len(p) for p in prompts(GEMMA2.vocab_size)) > GEMMA2.sliding_window
    assert runs["xla"]["1"]["tokens"] == want
    assert runs["xla"]["2"]["tokens"] == want
    assert runs["kernel"]["2"]["tokens"] == want
    assert runs["xla"]["2"]["heads"] == [4, 2]
