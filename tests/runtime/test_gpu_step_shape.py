"""The GPU step's shape (unrolled layers over per-layer weights, a branch-free sampler) run on
CPU: it computes what the CPU step (the layer loop, conditionals) computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runtime import backends
from models.layer_layout import unstack_layers
from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_GQA, seed=5)


def test_unrolled_layers_compute_the_layer_loop(model):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]  # [1, T]
    want, _ = model.module().apply({"params": model.params}, tokens, positions)
    per_layer = unstack_layers(model.params, TINY_GQA.num_layers)
    assert "layers" not in per_layer and set(per_layer) >= {"layers_0", "layers_1"}
    got, _ = model.module(unroll_layers=True).apply({"params": per_layer}, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_unstack_layers_keeps_abstract_params_abstract(model):
    abstract = jax.eval_shape(lambda p: p, model.params)
    out = unstack_layers(abstract, TINY_GQA.num_layers)
    leaf = jax.tree.leaves(out["layers_1"])[0]
    assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert leaf.shape == jax.tree.leaves(model.params["layers"])[0].shape[1:]


def generate(model, gpu_shape: bool, monkeypatch):
    monkeypatch.setattr(backends, "gpu_step", lambda: gpu_shape)
    # linear xla: the native float linears (kind cpu) unroll the CPU step too.
    llm = LLM(model, attention_backend="xla", linear_backend="xla", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=64, warmup=False)
    assert llm.engine.runner.unroll_layers == gpu_shape
    assert llm.engine.runner.branch_free_sampling == gpu_shape
    # The GPU step's sampling kernel, interpreted on this CPU.
    assert llm.engine.runner.sampler_backend == ("pallas-interpret" if gpu_shape else "xla")
    prompts = [[5, 9, 13, 2, 7], [100, 3], [42] * 20, [7, 7, 8]]
    params = [SamplingParams(max_tokens=8, temperature=0.0),
              SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=4,
                             repetition_penalty=1.2),
              SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4, logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_engine_with_the_gpu_step_shape_generates_what_the_cpu_step_does(model, monkeypatch):
    want = generate(model, False, monkeypatch)
    got = generate(model, True, monkeypatch)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[3][1] is not None
    for (_, lp_got), (_, lp_want) in zip(got, want):
        if lp_want is not None:
            for a, b in zip(lp_got, lp_want):
                assert a.keys() == b.keys()
                np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_layer_loop_knob_picks_the_loop(model, monkeypatch):
    monkeypatch.setattr(backends, "gpu_step", lambda: False)
    runs = {}
    for loop in ("auto", "scan", "unrolled"):
        llm = LLM(model, attention_backend="xla", linear_backend="xla", max_num_seqs=2,
                  max_model_len=64, warmup=False, layer_loop=loop)
        assert llm.engine.runner.unroll_layers == (loop == "unrolled")
        runs[loop] = [o.outputs[0].token_ids for o in llm.generate(
            [[5, 9, 13, 2, 7], [100, 3]], SamplingParams(max_tokens=6, temperature=0.0),
            use_tqdm=False)]
    assert runs["unrolled"] == runs["scan"] == runs["auto"]
    assert backends.unroll_layers("auto", tensor_parallel=True) is False
    # Float weights keep the scan on CPU (start-up time); weights packed for the native
    # quantized matmul unroll.
    assert backends.unroll_layers("auto", False, params=model.params) is False
    with pytest.raises(ValueError, match="layer_loop='unrolled' runs on one device"):
        backends.unroll_layers("unrolled", tensor_parallel=True)
    with pytest.raises(ValueError, match="layer_loop"):
        from jaxserve import EngineConfig
        EngineConfig(model="x", layer_loop="loop")
