"""Qwen3, Phi-3 and the RoPE scalings against tiny random transformers models.

Dense logits must equal HF's within test_model_hf's float32 tolerance, and the paged engine's
greedy tokens HF's greedy tokens (full recompute) under chunked prefill, with a block size
that divides none of the prompt lengths.
"""

import dataclasses

import numpy as np
import pytest

from hf_reference import run_reference
from models import load_model
from models.config import ModelConfig
from models.rope import attention_factor, inv_frequencies

pytestmark = pytest.mark.hf_ref

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1)  # larger than HF's 0.02: varied greedy continuations
_rng = np.random.default_rng(0)
SHORT, LONG = [round(float(x), 4) for x in 1 + _rng.random(8)], \
    [round(float(x), 4) for x in 2 + 8 * _rng.random(8)]
MODELS = [
    # head_dim 32 != hidden / heads: Qwen3 reads it from the config; tied like Qwen3 <= 4B.
    {"name": "qwen3", "model_type": "qwen3", "seed": 0, "greedy": True, "config": dict(
        BASE, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)},
    # Qwen3's long-context recipe: YaRN factor 4 over its original context.
    {"name": "qwen3_yarn", "model_type": "qwen3", "seed": 1, "greedy": True, "config": dict(
        BASE, head_dim=16, rope_theta=1e6, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})},
    # Phi-3 long-RoPE: per-frequency short/long factors, attention factor from 256 / 64.
    {"name": "phi3", "model_type": "phi3", "seed": 2, "greedy": True, "config": dict(
        BASE, original_max_position_embeddings=64, rope_scaling={
            "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG})},
    {"name": "phi3_plain", "model_type": "phi3", "seed": 3, "config": dict(
        BASE, num_key_value_heads=4, tie_word_embeddings=False)},
    {"name": "llama_linear", "model_type": "llama", "seed": 4, "greedy": True, "config": dict(
        BASE, rope_scaling={"rope_type": "linear", "factor": 2.5})},
    {"name": "llama_dynamic", "model_type": "llama", "seed": 5, "config": dict(
        BASE, rope_scaling={"rope_type": "dynamic", "factor": 3.0})},
]
PROMPTS = [[5, 17, 42, 3, 200, 7, 7, 7, 1], list(range(1, 150, 3)), [9]]
# 8 prompts, lengths 5..43, none a multiple of the engine's block size 8.
GREEDY_PROMPTS = [[int(x) for x in np.random.default_rng(10 + i).integers(3, 211, n)]
                  for i, n in enumerate([5, 9, 13, 19, 22, 30, 37, 43])]
GREEDY_TOKENS = 8
ROPE_CASES = [
    {"config": dict(BASE, head_dim=16, rope_theta=10000.0, rope_scaling=rope), "seq_lens": lens}
    for rope, lens in [
        ({"rope_type": "linear", "factor": 4.0}, [16]),
        ({"rope_type": "dynamic", "factor": 2.0}, [100, 256, 700]),
        ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
          "beta_fast": 16, "beta_slow": 2}, [16]),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
          "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}, [16]),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}, [16]),
        ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0,
          "original_max_position_embeddings": 256}, [100, 300]),
    ]]
ATOL = 2e-4  # test_model_hf's float32 tolerance


@pytest.fixture(scope="module")
def reference():
    return run_reference("ref_families", {
        "models": MODELS, "prompts": PROMPTS, "greedy_prompts": GREEDY_PROMPTS,
        "greedy_tokens": GREEDY_TOKENS, "rope_cases": ROPE_CASES})


@pytest.mark.parametrize("spec", MODELS, ids=[m["name"] for m in MODELS])
def test_logits_match_hf(reference, spec):
    model = load_model(reference["workdir"] / spec["name"], dtype="float32")
    for i, ids in enumerate(PROMPTS):
        if len(ids) > model.config.max_position_embeddings:
            continue
        np.testing.assert_allclose(model.forward_logits(ids), reference[f"{spec['name']}/{i}"],
                                   atol=ATOL, rtol=0)


def test_configs_read_from_hf(reference):
    q3 = load_model(reference["workdir"] / "qwen3").config
    assert (q3.architecture, q3.qk_norm, q3.head_dim, q3.attention_bias) == \
        ("qwen3", "per_head", 32, False)
    phi = load_model(reference["workdir"] / "phi3").config
    assert (phi.architecture, phi.rope_scaling.rope_type, phi.rope_scaling.factor) == \
        ("phi3", "longrope", 4.0)
    # Served up to the original context, where transformers uses short_factor throughout.
    assert phi.max_position_embeddings == 64


@pytest.mark.parametrize("c", range(len(ROPE_CASES)))
def test_rope_frequencies_match_hf(reference, c):
    case = ROPE_CASES[c]
    config = ModelConfig.from_hf(dict(case["config"], model_type="llama",
                                      max_position_embeddings=256))
    for n, factor in zip(case["seq_lens"], reference["json"]["rope_factors"][c]):
        np.testing.assert_allclose(inv_frequencies(config, n), reference[f"rope/{c}/{n}"],
                                   rtol=1e-6, atol=0)
        assert attention_factor(config) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("kind", ["su", "ntk-by-parts", "proportional"])
def test_unsupported_rope_type_is_named(kind):
    with pytest.raises(ValueError, match=f"unsupported rope type '{kind}'"):
        ModelConfig.from_hf(dict(BASE, model_type="llama",
                                 rope_scaling={"rope_type": kind, "factor": 2.0}))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_o_proj_bias_is_refused(model_type):
    # transformers gives these families an o_proj bias with attention_bias: not dropped silently.
    with pytest.raises(ValueError, match=f"{model_type} with attention_bias=true"):
        ModelConfig.from_hf(dict(BASE, model_type=model_type, attention_bias=True))


def test_hf_greedy_margins_are_clear(reference):
    # Greedy tokens are compared exactly: with logits within ATOL of HF's, a top-2 gap over
    # 2 * ATOL cannot flip the argmax.
    for spec in MODELS:
        if spec.get("greedy"):
            assert reference["json"]["margins"][spec["name"]] > 2 * ATOL, spec["name"]


@pytest.mark.parametrize("name", [m["name"] for m in MODELS if m.get("greedy")])
def test_paged_engine_greedy_matches_hf(reference, name):
    from jaxserve import EngineConfig, LLMEngine
    model = load_model(reference["workdir"] / name, dtype="float32")
    engine = LLMEngine(EngineConfig(model=model.source, dtype="float32", warmup=False,
                                    block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                                    max_model_len=64), model=model)
    for i, got in enumerate(engine_greedy(engine)):
        assert got == reference[f"{name}/greedy/{i}"].tolist(), (name, i)


def engine_greedy(engine) -> list[list[int]]:
    """GREEDY_TOKENS greedy tokens for each of GREEDY_PROMPTS, all in one engine's batch."""
    from jaxserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    for i, ids in enumerate(GREEDY_PROMPTS):
        engine.add_request(f"r{i}", ids, params)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    return [got[f"r{i}"] for i in range(len(GREEDY_PROMPTS))]


def test_longrope_past_original_context_is_refused():
    s = ModelConfig.from_hf(dict(BASE, model_type="phi3", original_max_position_embeddings=64,
                                 rope_scaling={"rope_type": "longrope", "short_factor": SHORT,
                                               "long_factor": LONG})).rope_scaling
    c = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4,
             num_kv_heads=2, head_dim=16, architecture="phi3")
    with pytest.raises(ValueError, match="exceeds original_max_position_embeddings 64"):
        ModelConfig(**c, rope_scaling=s, max_position_embeddings=65)
    assert ModelConfig(**c, rope_scaling=s, max_position_embeddings=64).rope_scaling == s


def test_sliding_window_caps_the_context():
    # Phi-3 mini applies its sliding window to every layer; until windows are served, the
    # context stops where the window would start to cut.
    c = ModelConfig.from_hf(dict(BASE, model_type="phi3", sliding_window=48))
    assert c.max_position_embeddings == 48
    q = ModelConfig.from_hf(dict(BASE, model_type="qwen3", sliding_window=48))
    assert q.max_position_embeddings == 256  # Qwen3: use_sliding_window is off by default
    assert dataclasses.replace(q).qk_norm == "per_head"


@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_orbax_roundtrip_keeps_family_fields(reference, tmp_path, name):
    from models.checkpoint import save as save_orbax
    model = load_model(reference["workdir"] / name)
    save_orbax(model, tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt")
    assert restored.config == model.config  # qk_norm, longrope factors (JSON lists -> tuples)
    np.testing.assert_allclose(restored.forward_logits(PROMPTS[0]), reference[f"{name}/0"],
                               atol=ATOL, rtol=0)
