"""The README's main command path: `jaxserve generate` on the default model, in a subprocess."""

import os
import socket
import subprocess
import sys

import pytest


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600)


HOST_CORES = [()] + ([("--host-cores", "1")] if hasattr(os, "sched_getaffinity")
                     and len(os.sched_getaffinity(0)) >= 2 else [])


@pytest.mark.parametrize("cores", HOST_CORES, ids=lambda c: "host-cores-1" if c else "default")
def test_generate_chat_answers_like_hf(smollm2_path, cores):
    # HF transformers' greedy answer on the same file (tests/e2e/test_smollm2_parity.py), here
    # from the file's own Q4_1 blocks with int8 activations.
    proc = run_cli("generate", "--chat", "What is the capital of France?", "--max-tokens", "24",
                   "--max-model-len", "256", "--max-num-seqs", "4", *cores)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "The capital of France is Paris."
    assert "finish=stop" in proc.stderr
    # A GGUF file is served in its own quantization by default, and start-up says so.
    assert "weights: the file's own Q4_1/Q8_0 blocks (quantization='none'" in proc.stderr
    if cores:  # XLA's pool kept off the host loop's CPU
        assert "host loop on CPU" in proc.stderr and "XLA's pool on CPU" in proc.stderr


def test_host_cores_the_process_cannot_give_are_refused():
    proc = run_cli("generate", "hi", "--host-cores", "4096")
    assert proc.returncode == 2
    assert "host cores must be an integer in [1, " in proc.stderr


def test_generate_rejects_bad_sampling_value():
    proc = run_cli("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature must be >= 0.0" in proc.stderr


def test_multihost_flags_come_together():
    proc = run_cli("generate", "hi", "--coordinator-address", "127.0.0.1:1")
    assert proc.returncode == 2
    assert "needs all of --coordinator-address, --num-processes and --process-id" in proc.stderr


CHAT = ("generate", "--chat", "What is the capital of France?", "--max-tokens", "24",
        "--max-model-len", "256", "--max-num-seqs", "4", "--tensor-parallel-size", "2")


@pytest.mark.subprocess
@pytest.mark.timeout(1000)  # the subprocess's own limit is 900 s
def test_generate_tensor_parallel_answers_like_hf(smollm2_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", *CHAT], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "The capital of France is Paris."


@pytest.mark.subprocess
@pytest.mark.timeout(1000)  # the subprocesses' own limit is 900 s
def test_generate_on_two_processes_answers_like_hf(smollm2_path):
    """The README's multi-host recipe on loopback: 2 processes x 1 CPU device."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *CHAT,
                               "--coordinator-address", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    # gloo prints "[Gloo] Rank i is connected ..." on stdout first.
    text = [ln for ln in outs[0][0].splitlines() if not ln.startswith("[Gloo]")]
    assert text == ["The capital of France is Paris."]
    assert "followed" in outs[1][1]


def test_prefix_caching_flag_reaches_the_engine_config():
    from jaxserve.cli import _engine_kwargs, build_parser
    args = build_parser().parse_args(["serve", "--no-prefix-caching"])
    assert _engine_kwargs(args)["enable_prefix_caching"] is False
    args = build_parser().parse_args(["serve"])
    assert _engine_kwargs(args)["enable_prefix_caching"] is True
