"""`jaxserve kv-size`: KV bytes from a model config, against hand-computed figures."""

import json
import os
import subprocess
import sys

import pytest

from jaxserve.tools.kv_size import kv_size
from models.config import ModelConfig
from models.config_io import load_config

# A Llama-2-13B-shaped config: 40 layers, d_model 5120, 40 heads of 128, no GQA.
LLAMA_13B_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
                "num_hidden_layers": 40, "num_attention_heads": 40,
                "max_position_embeddings": 4096}


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_13b_at_4096_tokens_is_3_36_gb_in_fp16():
    config = ModelConfig.from_hf(LLAMA_13B_HF)
    r = kv_size(config, batch=1, seq_len=4096, dtype="float16")
    # 2 (K and V) * 4096 tokens * 40 layers * 5120 * 2 bytes, by hand:
    assert r.total_bytes == 3_355_443_200 == r.textbook_bytes  # no GQA: both formulas agree
    assert r.bytes_per_token == 819_200
    assert kv_size(config, 8, 4096, "float32").total_bytes == 8 * 2 * 3_355_443_200


def test_budget_fits_whole_sequences():
    config = ModelConfig.from_hf(LLAMA_13B_HF)
    # 40 GB / 3.3554432 GB = 11.92 -> 11 sequences; paged: 40e9 // (16 * 819200) = 3051
    # blocks, minus the null block = 3050, each sequence needs 256 -> 11.
    r = kv_size(config, 1, 4096, "float16", budget=40_000_000_000)
    assert (r.fit_contiguous, r.fit_paged) == (11, 11)
    # A budget of exactly 2 sequences fits 2 contiguously but only 1 paged: the null block.
    r = kv_size(config, 1, 4096, "float16", budget=2 * 3_355_443_200)
    assert (r.fit_contiguous, r.fit_paged) == (2, 1)
    with pytest.raises(ValueError, match="seq_len"):
        kv_size(config, 1, 0)
    with pytest.raises(ValueError, match="dtype"):
        kv_size(config, 1, 16, "float64")


@pytest.mark.model
def test_smollm2_gqa_figure_from_gguf_metadata(smollm2_path):
    config = load_config(smollm2_path)  # metadata only
    assert (config.num_layers, config.num_kv_heads, config.head_dim,
            config.hidden_size) == (30, 3, 64, 576)
    r = kv_size(config, batch=1, seq_len=2048, dtype="float32")
    assert r.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080  # the engine's logged figure
    assert r.total_bytes == 94_371_840
    assert r.textbook_bytes == 2 * 2048 * 30 * 576 * 4 == 3 * r.total_bytes  # 9 heads / 3 KV


def test_cli_reads_a_config_json_and_refuses_unknown_models(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_13B_HF))
    for target in (path, tmp_path):  # the file, or the HF directory holding it
        proc = run_cli("kv-size", str(target), "--seq-len", "4096", "--budget", "40GB")
        assert proc.returncode == 0, proc.stderr
        assert "3,355,443,200 bytes (3.36 GB" in proc.stdout
        assert "holds 11 sequences of 4096 tokens" in proc.stdout
    proc = run_cli("kv-size", "no-such-model", "--seq-len", "16")
    assert proc.returncode == 2 and "neither a known model name" in proc.stderr
