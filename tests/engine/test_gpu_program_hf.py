"""The engine in its GPU configuration, run on CPU, against HF transformers' greedy tokens.

The GPU program (unrolled layers over per-layer weights, the branch-free sampler, the Pallas
attention kernel and Pallas linears; `backends.gpu_step()` true) with the kernels in interpret
mode, float32 so the tokens can be compared exactly with HF's float32 full recompute. The
models have head_dim 64, which the attention kernel takes (the family tests' tiny models use
16 and 32, which fall back to XLA attention)."""

import pytest

from test_model_families import (BASE, GREEDY_PROMPTS, GREEDY_TOKENS, engine_greedy,
                                 run_reference)

pytestmark = pytest.mark.hf_ref

MODELS = [
    # 2 queries per KV head, rope scaling on.
    {"name": "llama_hd64", "model_type": "llama", "seed": 20, "greedy": True, "config": dict(
        BASE, head_dim=64, rope_scaling={"rope_type": "linear", "factor": 2.0})},
    # 3 queries per KV head (SmolLM2's grouping, padded to 4 inside the kernel), q/k norms.
    {"name": "qwen3_hd64", "model_type": "qwen3", "seed": 21, "greedy": True, "config": dict(
        BASE, num_attention_heads=6, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True)},
]
# fp32 vs fp32: logits agree to summation order; a top-2 gap over this cannot flip.
MIN_MARGIN = 4e-4


@pytest.fixture(scope="module")
def reference():
    return run_reference("ref_families", {
        "models": MODELS, "prompts": [], "greedy_prompts": GREEDY_PROMPTS,
        "greedy_tokens": GREEDY_TOKENS})


@pytest.mark.parametrize("name", [m["name"] for m in MODELS])
def test_gpu_program_greedy_matches_hf(reference, name, monkeypatch):
    from jaxserve import EngineConfig, LLMEngine
    from jaxserve.runtime import backends
    from models import load_model
    assert reference["json"]["margins"][name] > MIN_MARGIN
    monkeypatch.setattr(backends, "gpu_step", lambda: True)
    model = load_model(reference["workdir"] / name, dtype="float32")
    engine = LLMEngine(EngineConfig(
        model=model.source, dtype="float32", warmup=False, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=16, max_model_len=64, attention_backend="pallas-interpret",
        linear_backend="pallas-interpret"), model=model)
    runner = engine.runner
    assert runner.unroll_layers and runner.branch_free_sampling
    assert runner.attention.name.startswith("pallas")
    for i, got in enumerate(engine_greedy(engine)):
        assert got == reference[f"{name}/greedy/{i}"].tolist(), (name, i)
