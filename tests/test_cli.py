"""The README's main command path: `jaxserve generate` on the default model, in a subprocess."""

import os
import subprocess
import sys


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_generate_chat_answers_like_hf(smollm2_path):
    # HF transformers' greedy answer on the same file (tests/test_smollm2_parity.py).
    proc = run_cli("generate", "--chat", "What is the capital of France?", "--max-tokens", "24",
                   "--max-model-len", "256", "--max-num-seqs", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "The capital of France is Paris."
    assert "finish=stop" in proc.stderr


def test_generate_rejects_bad_sampling_value():
    proc = run_cli("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature must be >= 0.0" in proc.stderr


def test_prefix_caching_flag_reaches_the_engine_config():
    from jaxserve.cli import _engine_kwargs, build_parser
    args = build_parser().parse_args(["serve", "--no-prefix-caching"])
    assert _engine_kwargs(args)["enable_prefix_caching"] is False
    args = build_parser().parse_args(["serve"])
    assert _engine_kwargs(args)["enable_prefix_caching"] is True
