"""Tiny random Llama / Qwen2 models made by transformers: our loaders + model vs HF logits."""

import json

import numpy as np
import pytest

from hf_reference import run_reference
from models import load_model
from models.checkpoint import save as save_orbax
from models.weights import CheckpointError

pytestmark = pytest.mark.hf_ref

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)
MODELS = [
    {"name": "llama", "arch": "llama", "seed": 0, "config": dict(BASE, rope_theta=10000.0)},
    {"name": "llama_sharded", "arch": "llama", "seed": 1, "max_shard_size": "100KB",
     "config": dict(BASE, tie_word_embeddings=True, num_key_value_heads=1)},
    {"name": "llama3_rope", "arch": "llama", "seed": 2, "config": dict(
        BASE, rope_theta=500000.0, max_position_embeddings=1024,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})},
    {"name": "qwen2", "arch": "qwen2", "seed": 3, "config": dict(
        BASE, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)},
]
PROMPTS = [[5, 17, 42, 3, 200, 7, 7, 7, 1], list(range(1, 150, 3)), [9]]
# fp32 vs fp32 on the same weights: differences come only from summation order (~1e-6
# relative); 2e-4 absolute on logits of magnitude ~1 leaves room for that, not for a bug.
ATOL = 2e-4


@pytest.fixture(scope="module")
def reference():
    return run_reference("ref_tiny_hf", {"models": MODELS, "prompts": PROMPTS})


@pytest.mark.parametrize("spec", MODELS, ids=[m["name"] for m in MODELS])
def test_logits_match_hf(reference, spec):
    model = load_model(reference["workdir"] / spec["name"], dtype="float32")
    for i, ids in enumerate(PROMPTS):
        np.testing.assert_allclose(model.forward_logits(ids), reference[f"{spec['name']}/{i}"],
                                   atol=ATOL, rtol=0)


def test_sharded_checkpoint_really_sharded(reference):
    files = reference["json"]["files"]["llama_sharded"]
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1


def test_config_read_from_hf(reference):
    model = load_model(reference["workdir"] / "qwen2")
    c = model.config
    assert (c.architecture, c.attention_bias, c.num_layers, c.num_kv_heads, c.head_dim) == \
        ("qwen2", True, 3, 2, 16)
    assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6 and not c.tie_word_embeddings
    scaled = load_model(reference["workdir"] / "llama3_rope").config.rope_scaling
    assert (scaled.factor, scaled.original_max_position_embeddings) == (8.0, 64)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_orbax_roundtrip_matches_hf(reference, tmp_path, name):
    model = load_model(reference["workdir"] / name)
    save_orbax(model, tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt")
    assert restored.config == model.config
    for i, ids in enumerate(PROMPTS):
        np.testing.assert_allclose(restored.forward_logits(ids), reference[f"{name}/{i}"],
                                   atol=ATOL, rtol=0)


def _copy_dir(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(reference, tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _copy_dir(reference["workdir"] / "llama", tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(d)


def test_shape_mismatch_is_named(reference, tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _copy_dir(reference["workdir"] / "llama", tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(8, 64\)"):
        load_model(d)


def test_truncated_safetensors_names_file(reference, tmp_path):
    d = _copy_dir(reference["workdir"] / "llama", tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_unsupported_architecture(reference, tmp_path):
    d = _copy_dir(reference["workdir"] / "llama", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mamba'"):
        load_model(d)
