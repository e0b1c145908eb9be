"""Tensor parallelism (jaxserve/runtime/sharding.py): same greedy tokens on 1, 2, 4, 8 devices, memory
per device from the arrays' shards, and the Megatron all-reduce count in the compiled program.

Multi-device runs happen in tests/tp_worker.py under XLA_FLAGS=...device_count=8 (a fresh
process: the device count is fixed when JAX starts, and this suite runs with one device).
"""

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig
from jaxserve.runtime.sharding import head_layout, make_mesh, pad_heads, param_specs
from models.config import ModelConfig
from models.quantized import Int4Weight
from models.random_init import random_model

# The `runs` fixture's worker has its own 900 s limit; it counts toward the first test using it.
pytestmark = pytest.mark.timeout(1000)

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).resolve().parents[1] / "tp_worker.py"


def run_worker(jobs: dict, timeout=900) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(jobs)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def runs():
    return run_worker({
        "gqa": ["tokens", {"config_name": "gqa", "sizes": [1, 2, 4, 8]}],
        "smol_heads": ["tokens", {"config_name": "smol_heads", "sizes": [1, 2, 8]}],
        # The Pallas kernel per shard (shard_map), interpreted; compared with gqa's 1 device.
        "kernel": ["tokens", {"config_name": "gqa", "sizes": [4],
                              "attention_backend": "pallas-interpret"}],
        "int4": ["int4", {"sizes": [1, 2]}],
        # int8 codes are stored output-major ([N, K]): their split axes swap (and the int8 head).
        "w8a8": ["int4", {"sizes": [1, 2, 4], "quantization": "w8a8"}],
        # The int4 Pallas matmul per shard (interpreted) against the XLA int4 path on 1 device.
        "int4_kernel": ["int4", {"sizes": [2], "linear_backend": "pallas-interpret"}],
        # A kernel linear backend (the GPU default) with int8 weights and an int8 head: they
        # run XLA dots, partitioned as on the xla backend, against w8a8 on 1 device.
        "w8a8_kernel": ["int4", {"sizes": [2], "quantization": "w8a8",
                                 "linear_backend": "pallas-interpret"}],
        # int8 KV cache: scales split by KV head as the codes; the native kernel per shard
        # (the CPU default), the XLA path by annotations and the Pallas kernel per shard.
        "int8": ["tokens", {"config_name": "gqa", "sizes": [1, 2, 4], "kv_cache_dtype": "int8"}],
        "int8_xla": ["tokens", {"config_name": "gqa", "sizes": [2], "kv_cache_dtype": "int8",
                                "attention_backend": "xla"}],
        "int8_kernel": ["tokens", {"config_name": "gqa", "sizes": [2], "kv_cache_dtype": "int8",
                                   "attention_backend": "pallas-interpret"}],
        "hlo": ["hlo", {"n": 4}],
        # LoRA slots split by their kernels' roles; two adapters and the base in one batch.
        "lora": ["lora", {"sizes": [1, 2, 4]}],
        "warmup": ["warmup", {"n": 4}],
        # Embeddings (the pooled step variant) beside generation.
        "embed": ["embed", {"sizes": [1, 2]}],
        "hlo_int4_kernel": ["hlo", {"n": 2, "quantization": "int4",
                                    "linear_backend": "pallas-interpret"}],
    })


@pytest.mark.subprocess  # the `runs` worker: its whole 8-device process starts here
def test_lora_adapters_under_tensor_parallelism_equal_one_device(runs):
    lora = runs["lora"]
    one = lora["1"]["tokens"]
    # Prompts x (base, adapter 1, adapter 2): the adapters change what the base says.
    assert one[0] != one[1] and one[0] != one[2]
    for n in ("2", "4"):
        assert lora[n]["tokens"] == one, n
        # Column-parallel q_proj: A whole, B split on N; row-parallel down_proj: A split on K.
        assert lora[n]["specs"] == {
            "q_proj": ["P(None, None, None, None)", "P(None, None, None, 'model')"],
            "down_proj": ["P(None, 'model', None, None)", "P(None, None, None, None)"]}, n


# ---- head layout (pure Python) ------------------------------------------------------------

@pytest.mark.parametrize("heads,kv,n,expect", [
    (16, 8, 8, (16, 8)), (16, 8, 4, (16, 8)),   # K divisible by N: unchanged
    (9, 3, 2, (12, 4)), (9, 3, 4, (12, 4)),     # pad KV heads 3 -> 4 (and q heads 9 -> 12)
    (9, 3, 8, (16, 8)),                         # pad to 4, replicate x2, 2 q slots per copy
    (8, 2, 8, (8, 8)),                          # replicate x4, group of 4 dealt 1 per copy
    (9, 3, 3, (9, 3)), (9, 3, 1, (9, 3)),
])
def test_head_layout_counts(heads, kv, n, expect):
    layout = head_layout(heads, kv, n)
    assert (layout.num_heads, layout.num_kv_heads) == expect
    assert layout.num_heads % n == 0 and layout.num_kv_heads % n == 0


@pytest.mark.parametrize("heads,kv,n", [(9, 3, 2), (9, 3, 4), (9, 3, 8), (8, 2, 8), (12, 4, 8),
                                        (15, 5, 4), (16, 8, 8)])
def test_head_layout_keeps_every_query_with_its_kv_head(heads, kv, n):
    layout = head_layout(heads, kv, n)
    g_new = layout.num_heads // layout.num_kv_heads
    real = [q for q in layout.q_src if q >= 0]
    assert sorted(real) == list(range(heads))  # every original query head exactly once
    for i, q in enumerate(layout.q_src):
        if q >= 0:  # its new KV head is a copy of the original's KV head
            assert layout.kv_src[i // g_new] == q // (heads // kv)


def test_pad_heads_computes_the_same_function():
    """Zero and replicated heads change nothing: dense logits equal the original model's."""
    config = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
                         num_heads=9, num_kv_heads=3, head_dim=16, attention_bias=True)
    model = random_model(config, seed=1)
    # Flax initialises biases to zero; give them values so their padding is exercised.
    attn = model.params["layers"]["attn"]
    rng = np.random.default_rng(0)
    biased = {k: dict(v, bias=rng.normal(size=v["bias"].shape).astype(np.float32))
              if "bias" in v else v for k, v in attn.items()}
    params = dict(model.params, layers=dict(model.params["layers"], attn=biased))
    model = dataclasses.replace(model, params=jax.tree.map(jax.numpy.asarray, params))
    ids = rng.integers(0, 64, 13).tolist()
    want = model.forward_logits(ids)
    for n in (2, 8):  # padding only; padding and replication
        padded = pad_heads(model, n)
        assert padded.config.num_heads % n == 0 and padded.config.num_kv_heads % n == 0
        np.testing.assert_allclose(padded.forward_logits(ids), want, rtol=1e-5, atol=1e-5)


# ---- validation -----------------------------------------------------------------------------

def test_too_many_devices_is_an_actionable_error():
    n = jax.device_count() + 1
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh(n)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_quantization_groups_must_not_straddle_devices():
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=512, num_layers=1,
                         num_heads=8, num_kv_heads=8, head_dim=8)
    shapes = jax.eval_shape(lambda: random_model(config).params)
    down = Int4Weight(packed=jax.ShapeDtypeStruct((1, 256, 64), np.uint8),  # K = 512, g = 128
                      scales=jax.ShapeDtypeStruct((1, 4, 64), np.float32), group_size=128)
    layers = dict(shapes["layers"], mlp=dict(shapes["layers"]["mlp"],
                                             down_proj={"kernel": down}))
    params = dict(shapes, layers=layers)
    specs = param_specs(params, config, 4)  # 128 rows per device: whole groups
    assert specs["layers"]["mlp"]["down_proj"]["kernel"].packed == \
        jax.sharding.PartitionSpec(None, "model", None)
    with pytest.raises(ValueError, match="not a multiple of the quantization group size 128"):
        param_specs(params, config, 8)  # 64 rows per device: a group would straddle


# ---- multi-device runs ----------------------------------------------------------------------

@pytest.mark.parametrize("label", ["gqa", "smol_heads", "kernel", "int4", "int4_kernel", "w8a8",
                                   "w8a8_kernel", "int8", "int8_xla", "int8_kernel"])
@pytest.mark.subprocess
def test_same_greedy_tokens_as_one_device(runs, label):
    one = runs[{"kernel": "gqa", "int4_kernel": "int4", "w8a8_kernel": "w8a8",
                "int8_xla": "int8", "int8_kernel": "int8"}.get(label, label)]["1"]["tokens"]
    assert len(one) == 2 and all(len(t) == 5 for t in one)
    for n, result in runs[label].items():
        assert result["tokens"] == one, f"tensor_parallel_size={n}"


@pytest.mark.subprocess
def test_single_device_run_is_the_dense_oracle(runs):
    from tp_worker import GQA, prompts
    model = random_model(GQA, seed=3)
    want = [model.greedy_generate(p, 5, stop_token_ids=()) for p in prompts(GQA.vocab_size)]
    assert runs["gqa"]["1"]["tokens"] == want


def _expected_bytes(c: ModelConfig, n: int) -> int:
    """Per-device f32 weight bytes of the Megatron layout, from the config alone."""
    d, f, v, dh, h, k = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim,
                         c.num_heads, c.num_kv_heads)
    split = c.num_layers * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f)
    split += v * d * (1 if c.tie_word_embeddings else 2)  # vocab-parallel table(s)
    replicated = c.num_layers * 2 * d + d  # norms
    return 4 * (split // n + replicated)


@pytest.mark.subprocess
@pytest.mark.parametrize("label", ["gqa", "smol_heads"])
def test_memory_per_device_shrinks(runs, label):
    from tp_worker import GQA, SMOL_HEADS
    base = {"gqa": GQA, "smol_heads": SMOL_HEADS}[label]
    for n, r in runs[label].items():
        n = int(n)
        h, kv = r["heads"]
        c = ModelConfig(**dict(base.to_dict(), num_heads=h, num_kv_heads=kv, rope_scaling=None,
                               eos_token_ids=()))
        print(f"{label} tp={n}: heads {h}/{kv}, weights/device {r['weights'][0]} B, "
              f"KV/device {r['kv'][0]} B for {r['num_blocks']} blocks")
        assert r["weights"] == [_expected_bytes(c, n)] * n
        # KV: this device's heads of every block, [L, NB, BS, K/N, Dh] for K and V.
        per_block = 2 * c.num_layers * 16 * (kv // n) * c.head_dim * 4
        assert r["kv"] == [r["num_blocks"] * per_block] * n
    one, eight = runs[label]["1"], runs[label]["8"]
    if label == "gqa":  # nothing padded: an eighth per device, norms (replicated) aside
        norms = 4 * (base.num_layers * 2 * base.hidden_size + base.hidden_size)
        assert (eight["weights"][0] - norms) * 8 == one["weights"][0] - norms
        assert eight["kv"][0] / eight["num_blocks"] * 8 == one["kv"][0] / one["num_blocks"]


@pytest.mark.subprocess
def test_nothing_compiles_after_warmup_on_4_devices(runs):
    r = runs["warmup"]
    assert r["tokens"] == runs["gqa"]["1"]["tokens"]
    assert r["compiled"] > 1 and r["after_warmup"] == 0


@pytest.mark.subprocess
def test_embeddings_as_on_one_device(runs):
    one, two = runs["embed"]["1"], runs["embed"]["2"]
    assert one["tokens"] == two["tokens"] == runs["gqa"]["1"]["tokens"]
    # float32: only the all-reduces' summation order differs.
    np.testing.assert_allclose(two["embeddings"], one["embeddings"], atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(one["embeddings"], axis=1), 1.0)


@pytest.mark.subprocess
def test_two_all_reduces_per_layer(runs):
    """Megatron: one all-reduce after attention, one after the MLP, nothing else per layer."""
    for label in ("hlo", "hlo_int4_kernel"):  # annotations; int4 kernel under shard_map + psum
        assert runs[label] == {"decode": {"all-reduce": 2}, "prefill": {"all-reduce": 2}}


@pytest.mark.model
@pytest.mark.subprocess
@pytest.mark.timeout(1900)  # run_worker's own limit is 1800 s
def test_smollm2_same_greedy_tokens_on_1_2_4_devices():
    result = run_worker({"smol": ["smollm2", {"sizes": [1, 2, 4]}]}, timeout=1800)["smol"]
    one = result["1"]["tokens"]
    assert all(len(t) == 16 for t in one)
    for n, r in result.items():
        print(f"SmolLM2 tp={n}: heads {r['heads']}, weights/device {r['weights'][0] / 2**20:.1f}"
              f" MiB, KV/device {r['kv'][0] / r['num_blocks'] / 1024:.1f} KiB per block")
        assert r["tokens"] == one, f"tensor_parallel_size={n}"


@pytest.fixture(scope="module")
def loopback():
    """Multi-host on one machine: 2 processes x 1 CPU device, process 0 broadcasting calls."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, str(WORKER.parent / "mh_worker.py"), str(i),
                               str(port)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, err[-4000:]
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            p.kill()
    return results


@pytest.mark.subprocess
def test_two_processes_on_loopback(runs, loopback):
    """Multi-host on one machine: 2 processes x 1 CPU device, process 0 broadcasting steps."""
    leader, follower = loopback
    assert leader["tokens"] == runs["gqa"]["1"]["tokens"]
    assert follower["steps"] > 0
    # Each process holds one shard of a cache that spans both processes' devices.
    assert leader["devices"] == follower["devices"] == [1, 2]


@pytest.mark.subprocess
def test_two_processes_copy_on_write_like_one_process(loopback):
    """Prefix-cache hits and n > 1 forks copy KV blocks: every process must copy its shard.
    And the prompt-logprobs step variant runs on both processes as on one."""
    from tp_worker import (GQA, engine, greedy, greedy_waves, prompt_logprobs, prompts,
                           shared_prefix_waves)
    eng = engine(random_model(GQA, seed=3), 1)  # the same workloads on one process
    greedy(eng, prompts(GQA.vocab_size))
    want = greedy_waves(eng, shared_prefix_waves(GQA.vocab_size))
    want_lps = prompt_logprobs(eng, prompts(GQA.vocab_size))
    leader, follower = loopback
    assert leader["stats"]["cow_copies"] > 0 and leader["stats"]["prefix_cache_hits_blocks"] > 0
    assert leader["waves"] == want
    for got, lps in zip(leader["prompt_logprobs"], want_lps):
        np.testing.assert_allclose(got, lps, atol=1e-5, rtol=0)
    assert follower["copies"] > 0


def test_sharded_kernel_step_compiles_for_4_h200s():
    """The TP step with both Pallas kernels under shard_map, compiled for 4 compile-only H200s.

    Deviceless (jax-cuda13-plugin): Triton lowering of the per-shard kernels, NCCL collectives,
    and the layer loop's all-reduce count in the GPU program.
    """
    from jaxserve.runtime import backends
    from jaxserve.runtime.kv_cache import KVCache
    from jaxserve.quantization import quantize_params_int4
    from jaxserve.runtime import slot_state
    from jaxserve.runtime.runner import ModelRunner, step_module
    from jaxserve.runtime.sharding import TensorParallel
    from hlo_collectives import collectives_in_layer_loop
    from jax.experimental import topologies
    from tests import cuda_lowering
    from tp_worker import SMOL_HEADS

    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    n = 4
    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}",
                                        target_config=cuda_lowering.H200_TARGET_CONFIG)
    tp = TensorParallel(jax.sharding.Mesh(topo.devices, ("model",)))
    # SmolLM2's head counts with its head_dim (the kernel's 64), padded for 4 devices.
    config = ModelConfig(**dict(SMOL_HEADS.to_dict(), head_dim=64, hidden_size=128,
                                rope_scaling=None, eos_token_ids=()))
    model = pad_heads(random_model(config), n)
    # Groups of 64: o_proj's 12 * 64 rows give 192 per device, which groups of 128 would straddle.
    params = jax.eval_shape(lambda p: quantize_params_int4(p, group_size=64), model.params)
    shardings = tp.param_shardings(params, model.config)
    c, bs = model.config, 16
    attention = backends.attention_backend("pallas", c, bs, "pallas")
    # The runner's own step body, without a runner's device arrays.
    runner = ModelRunner.__new__(ModelRunner)
    runner.tp, runner.ragged, runner.max_model_len, runner.block_size = tp, False, 64, bs
    runner.num_slots, runner.idle_slot = 4, 4
    runner.poison_rows, runner.num_speculative_tokens = False, 0  # no fault hook, no drafts
    runner.lora = None  # no adapter slots
    runner.page_table = np.zeros((5, 64 // bs), np.int32)
    runner._module = step_module(model, tp.attention(attention),
                                 tp.linear(backends.linear_backend("pallas")))
    # A bf16 cache, as on a GPU: the attention kernel writes it (an f32 one takes a write
    # kernel of its own).
    cache_shape = jax.ShapeDtypeStruct((c.num_layers, 32, bs, c.num_kv_heads, c.head_dim),
                                       jax.numpy.bfloat16,
                                       sharding=tp.cache_shardings.k)
    rep = tp.replicated
    idle = runner.step_template(16)  # a ragged step of 16 flat tokens

    def spec(x, sharding=rep):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    args = (jax.tree.map(spec, params, shardings), KVCache(k=cache_shape, v=cache_shape),
            jax.tree.map(spec, slot_state.new_state(5, 64)), jax.tree.map(spec, idle.inputs))
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only client
    try:
        with jax.set_mesh(tp.mesh):
            step = jax.jit(runner._step_impl, donate_argnums=(1, 2),
                           **tp.step_jit_kwargs(shardings))
            compiled = step.trace(*args).lower().compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    hlo = compiled.as_text()
    # One Triton call per kernel in the layer body: 7 int4 linears and the ragged attention,
    # which writes the KV cache and, in this prefill-shaped bucket (16 tokens, 4 rows), runs
    # as two calls: the short rows on their own tile, then the others; its pages split over
    # programs (4 rows of one KV head per device fill no H200), one merge_splits call.
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 10
    assert hlo.count("merge_splits") >= 1
    assert collectives_in_layer_loop(hlo) == {"all-reduce": 2}
